"""`inferbus models` archive/unarchive/delete/download and the progress bars.

The live tests run the real registry in-process (real nats-server, local
store) and the CLI's blocking gRPC code in a thread, exactly as a user's shell
would call it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import secrets
from pathlib import Path

import pytest

from inferbus_cli.__main__ import main
from inferbus_cli.progress import ProgressBar, human_bytes
from inferbus_client.artifacts import collect_files, push_messages
from inferbus_registry.app import RegistryApp


def test_progress_bar_counts_and_draws() -> None:
    out = io.StringIO()
    bar = ProgressBar(3 << 20, "push m 1", stream=out, enabled=True, interval_s=0)
    for _ in range(3):
        bar.advance(1 << 20)
    bar.close()
    bar.close()  # idempotent
    text = out.getvalue()
    assert bar.done == 3 << 20
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "100% 3.0 MiB/3.0 MiB" in text.splitlines()[-1].split("\r")[-1]
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(12) == "12 B"


def test_progress_bar_is_silent_when_not_a_terminal() -> None:
    out = io.StringIO()  # isatty() is False
    with ProgressBar(10, "x", stream=out) as bar:
        bar.advance(10)
    assert out.getvalue() == "" and bar.done == 10


def test_push_progress_reports_every_byte(tmp_path: Path) -> None:
    version = tmp_path / "v"
    version.mkdir()
    (version / "config.json").write_text(
        json.dumps(
            {
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            }
        )
    )
    (version / "model.onnx").write_bytes(secrets.token_bytes((5 << 20) // 2))
    (version / "labels.txt").write_text("a\nb\n")
    config, files = collect_files(version, None)
    out = io.StringIO()
    bar = ProgressBar(sum(p.stat().st_size for _, p in files), "p", stream=out, enabled=True)
    messages = list(push_messages("m", "1", config, [], files, bar.advance))
    bar.close()
    assert bar.done == bar.total == sum(p.stat().st_size for _, p in files)
    assert sum(len(m.chunk.data) for m in messages[1:]) == bar.done


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_push_download_archive_delete(
    registry: RegistryApp, fraud_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = ["--registry", f"127.0.0.1:{registry.grpc_port}"]
    model = fraud_model
    size = (model / "model.onnx").stat().st_size
    pushed = sum(p.stat().st_size for _, p in collect_files(model, None)[1])

    assert (
        await _cli(
            "models", "push", str(model), "--name", "fraud", "--version", "1", "--progress", *reg
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "100%" in err and f"{human_bytes(pushed)}/{human_bytes(pushed)}" in err
    assert await _cli("models", "push", str(model), "--name", "fraud", "--version", "2", *reg) == 0
    assert "\r" not in capsys.readouterr().err  # no bar: stderr is not a terminal

    out = tmp_path / "dl"
    out.mkdir()
    code = await _cli(
        "models", "download", "fraud", "--version", "2", "-o", str(out), "--progress", *reg
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    got = out / "model.onnx"
    assert got.read_bytes() == (model / "model.onnx").read_bytes()
    assert f"({size} bytes, SHA-256 checked)" in captured.out
    assert f"{human_bytes(size)}/{human_bytes(size)}" in captured.err
    assert hashlib.sha256(got.read_bytes()).hexdigest()

    # Archive and delete are refused while an alias holds the version, with the alias named.
    assert await _cli("models", "archive", "fraud", "1", *reg) == 1
    assert "alias 'stable'" in capsys.readouterr().err
    assert await _cli("models", "archive", "fraud", "2", "--json", *reg) == 0
    assert json.loads(capsys.readouterr().out)["archived"] == ["2"]
    assert await _cli("models", "alias", "fraud", "canary", "2", *reg) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    assert await _cli("models", "list", *reg) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split() == ["MODEL", "VERSIONS", "ALIASES", "ARCHIVED", "SERVING"]
    assert listing[-1].split()[3:] == ["2", "yes"]
    assert await _cli("models", "unarchive", "fraud", "2", *reg) == 0
    assert "archived -" in capsys.readouterr().out
    assert await _cli("models", "delete", "fraud", "2", *reg) == 1  # no --yes, no terminal
    assert "--yes" in capsys.readouterr().err
    assert await _cli("models", "delete", "fraud", "2", "--yes", *reg) == 0
    assert "versions 1;" in capsys.readouterr().out
    assert await registry.store.list("models/fraud/2/") == []


async def test_push_of_a_bare_onnx_file_derives_its_config(
    registry: RegistryApp, fraud_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Triton's auto-complete: no config.json, the registry reads the graph."""
    from inferbus_testing.stringmodels import write_identity_bytes

    reg = ["--registry", f"127.0.0.1:{registry.grpc_port}"]
    bare = fraud_model / "model.onnx"
    assert await _cli("models", "push", str(bare), "--name", "auto", "--version", "1", *reg) == 0
    err = capsys.readouterr().err
    assert "derived it from model.onnx" in err
    assert "input  input: FP32 [-1, 64]" in err
    assert "output probabilities: FP32 [-1, 2]" in err
    assert "max_batch_size 32" in err
    assert await _cli("models", "get", "auto", "--version", "1", *reg) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["name"] == "auto"
    assert config["max_batch_size"] == 32
    assert config["inputs"] == [
        {
            "name": "input",
            "datatype": "FP32",
            "shape": [-1, 64],
            "max_element_bytes": None,
            "truncate": False,
        }
    ]
    # String tensors become BYTES; pushing the same file again changes nothing.
    strings = write_identity_bytes(tmp_path / "strid") / "model.onnx"
    assert await _cli("models", "push", str(strings), "--name", "s", "--version", "1", *reg) == 0
    assert "input  IN: BYTES [-1, -1]" in capsys.readouterr().err
    assert await _cli("models", "push", str(strings), "--name", "s", "--version", "1", *reg) == 0


async def test_push_of_an_onnx_file_without_batch_axis_takes_shapes_literally(
    registry: RegistryApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [3, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "fixed.onnx"
    onnx.save_model(model, str(path))
    reg = ["--registry", f"127.0.0.1:{registry.grpc_port}"]
    assert await _cli("models", "push", str(path), "--name", "fixed", "--version", "1", *reg) == 0
    err = capsys.readouterr().err
    assert "input  x: INT32 [3, 4]" in err
    assert "max_batch_size 0 (no batch axis" in err
    # Not ONNX at all: a clear refusal, nothing stored.
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    assert await _cli("models", "push", str(junk), "--name", "junk", "--version", "1", *reg) == 1
    assert "not a valid ONNX model" in capsys.readouterr().err


async def test_list_shows_each_version_with_its_number(
    registry: RegistryApp, fraud_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = ["--registry", f"127.0.0.1:{registry.grpc_port}"]
    for version in ("1.0.0", "3"):
        push = ["models", "push", str(fraud_model), "--name", "fraud", "--version", version]
        assert await _cli(*push, *reg) == 0
    capsys.readouterr()
    assert await _cli("models", "list", *reg) == 0
    # 1.0.0 is number 1 (perf_analyzer -x 1); an integer version is its own number.
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["fraud", "1.0.0#1,3"]
    assert await _cli("models", "list", "--json", *reg) == 0
    assert json.loads(capsys.readouterr().out)[0]["numbers"] == {"1.0.0": 1, "3": 3}
