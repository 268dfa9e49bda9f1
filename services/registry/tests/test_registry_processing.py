"""Pushing versions with pre/post-processing: files present and readable, the ONNX
graph checked against the engine-facing tensors, clear INVALID_ARGUMENT otherwise."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from inferbus_client.registry import RegistryClient
from inferbus_common.errors import InvalidArgument, NotFound

REPO = Path(__file__).resolve().parents[3]


def _load_textcls() -> ModuleType:
    path = REPO / "examples" / "textcls" / "make_model.py"
    spec = importlib.util.spec_from_file_location("inferbus_example_textcls", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def textcls_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("textcls")
    _load_textcls().write_model(out)
    return out


@pytest.fixture
def textcls(textcls_src: Path, tmp_path: Path) -> Path:
    """A fresh copy of the example text classifier, free to break."""
    return Path(shutil.copytree(textcls_src, tmp_path / "textcls"))


def _edit_config(d: Path, change: Callable[[dict], None]) -> None:
    doc = json.loads((d / "config.json").read_text())
    change(doc)
    (d / "config.json").write_text(json.dumps(doc))


async def test_push_with_processing_stores_every_file(
    client: RegistryClient, textcls: Path
) -> None:
    info = await client.push(textcls, "textcls", "1.0.0")
    assert {"tokenizer.json", "labels.txt", "model.onnx", "config.json"} <= {
        f.path for f in info.files
    }
    stored = json.loads(info.config_json)
    assert stored["processing"]["pre"][0]["kind"] == "tokenize"
    assert [s["name"] for s in stored["inputs"]] == ["text"]


def _remove(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def _config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda d: _edit_config(d, change)


def _max_length_16(doc: dict) -> None:
    doc["processing"]["pre"][0]["max_length"] = 16
    for spec in doc["processing"]["engine_inputs"]:
        spec["shape"] = [-1, 16]


def _k_5(doc: dict) -> None:
    doc["processing"]["post"][1]["k"] = 5
    doc["outputs"][0]["shape"] = [-1, 5]
    doc["outputs"][1]["shape"] = [-1, 5]


def _logits_renamed(doc: dict) -> None:
    doc["processing"]["engine_outputs"][0]["name"] = "scores"
    doc["processing"]["post"][0]["input"] = "scores"


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (_remove("labels.txt"), r"processing reads 'labels\.txt' but the push did not send it"),
        (_remove("tokenizer.json"), r"processing reads 'tokenizer\.json'"),
        (_write("tokenizer.json", "{not json"), "is not valid JSON"),
        (_write("tokenizer.json", '{"version": "1.0"}'), "is not a `tokenizers` tokenizer.json"),
        (_write("labels.txt", "a\nb\n"), r"has 2 labels but 'probabilities' has 3 classes"),
        (_write("labels.txt", "\n\n"), "is empty"),
        (_config(_k_5), "asks for k=5 but 'probabilities' has 3 classes"),
        # The graph is compared with the engine-facing tensors.
        (_config(_max_length_16), r"'input_ids' dimension 1 is 16 in config\.json but 32"),
        (
            _config(_logits_renamed),
            "output 'scores' is not an output of the ONNX model",
        ),
        (
            _config(lambda doc: doc["processing"]["pre"][0].update(kind="lowercase")),
            "does not match any of the expected tags",
        ),
    ],
)
async def test_bad_processing_is_invalid_argument(
    client: RegistryClient, textcls: Path, breakage: Callable[[Path], None], message: str
) -> None:
    breakage(textcls)
    with pytest.raises(InvalidArgument, match=message):
        await client.push(textcls, "textcls", "1.0.0")
    with pytest.raises(NotFound):
        await client.get_version("textcls", "1.0.0")
