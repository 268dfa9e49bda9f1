"""What `models push` sends: the files of a version and the PushVersion stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferbus_client.artifacts import CHUNK_BYTES, PushError, collect_files, push_messages

CONFIG = {
    "name": "fraud",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}],
}


def write_version(path: Path, config: dict = CONFIG) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.onnx").write_bytes(b"onnx-bytes")
    (path / ".gitignore").write_text("*\n")
    (path / "extra").mkdir()
    (path / "extra" / "vocab.txt").write_text("a\nb\n")
    return path


def test_directory_push_skips_config_and_hidden_files(tmp_path: Path) -> None:
    version = write_version(tmp_path / "v1")
    config, files = collect_files(version, None)
    assert json.loads(config) == CONFIG
    assert [name for name, _ in files] == ["extra/vocab.txt", "model.onnx"]


def test_single_file_push_takes_the_config_file_name(tmp_path: Path) -> None:
    version = write_version(tmp_path / "v1")
    single = tmp_path / "my-model.onnx"
    single.write_bytes(b"x")
    _config, files = collect_files(single, version / "config.json")
    assert files == [("model.onnx", single)]
    # Without a config, a .onnx file goes with none: the registry derives it.
    config, files = collect_files(single, None)
    assert (config, files) == (b"", [("model.onnx", single)])
    other = tmp_path / "model.plan"
    other.write_bytes(b"x")
    with pytest.raises(PushError, match="--config"):
        collect_files(other, None)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json"),
        (lambda d: (d / "model.onnx").unlink(), "does not hold it"),
        (lambda d: (d / "config.json").write_text('{"inputs": []}'), "not a valid model config"),
    ],
)
def test_bad_versions_are_refused_before_sending(tmp_path: Path, mutate, message: str) -> None:
    version = write_version(tmp_path / "v1")
    mutate(version)
    with pytest.raises(PushError, match=message):
        collect_files(version, None)
    with pytest.raises(PushError, match="does not exist"):
        collect_files(tmp_path / "missing", None)


def test_stream_is_header_then_1mib_chunks(tmp_path: Path) -> None:
    big = tmp_path / "model.onnx"
    big.write_bytes(b"a" * CHUNK_BYTES + b"b" * 10)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    messages = list(
        push_messages("fraud", "1", b"{}", ["stable"], [("model.onnx", big), ("empty.txt", empty)])
    )
    header = messages[0]
    assert header.WhichOneof("kind") == "header"
    assert (header.header.model, header.header.version) == ("fraud", "1")
    assert list(header.header.aliases) == ["stable"]
    assert header.header.config_json == b"{}"
    chunks = [m.chunk for m in messages[1:]]
    assert [(c.path, len(c.data)) for c in chunks] == [
        ("model.onnx", CHUNK_BYTES),
        ("model.onnx", 10),
        ("empty.txt", 0),
    ]


def test_pickles_go_without_a_config(tmp_path: Path) -> None:
    # A scikit-learn pickle, alone or in a directory without config.json: the
    # registry converts it to model.onnx and derives the config.
    pkl = tmp_path / "clf.pkl"
    pkl.write_bytes(b"pickle")
    assert collect_files(pkl, None, derive=True) == (b"", [("model.pkl", pkl)])
    job = tmp_path / "reg.joblib"
    job.write_bytes(b"joblib")
    assert collect_files(job, None) == (b"", [("model.joblib", job)])
    version = tmp_path / "v"
    version.mkdir()
    (version / "model.joblib").write_bytes(b"joblib")
    (version / "sample.npy").write_bytes(b"npy")
    config, files = collect_files(version, None)
    assert (config, [n for n, _ in files]) == (b"", ["model.joblib", "sample.npy"])
    # A directory with neither a config nor a pickle still needs its config.
    (version / "model.joblib").unlink()
    with pytest.raises(PushError, match=r"needs config\.json"):
        collect_files(version, None)
