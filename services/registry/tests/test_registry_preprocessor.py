"""preprocessor.py at push (issue 27): compiled and read, never run; the config's
``processing.python`` filled in; engine tensors that need a missing function refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_registry.processingcheck import (
    check_processing,
    python_functions,
    with_python_file,
)

BASE = {
    "name": "m",
    "max_batch_size": 8,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
}


def _config(**processing: object) -> ModelConfig:
    raw = dict(BASE)
    if processing:
        raw["processing"] = processing
    return ModelConfig.model_validate(raw)


def test_both_functions_found_without_running_the_file() -> None:
    src = (
        b"import os\nos._exit(9)\n"
        b"def preprocess(i):\n    return i\n"
        b"def postprocess(o):\n    return o\n"
    )
    assert python_functions(src, "m", "preprocessor.py") == {"preprocess", "postprocess"}


def test_one_function_is_enough() -> None:
    assert python_functions(b"def postprocess(o):\n    return o\n", "m", "p.py") == {"postprocess"}


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (b"def preprocess(:\n", "does not compile"),
        (b"x = 1\n", "defines neither"),
        (b"def helper():\n    def preprocess(i): pass\n", "defines neither"),
        (b"async def preprocess(i):\n    return i\n", "plain def"),
    ],
)
def test_refused(source: bytes, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        python_functions(source, "m", "preprocessor.py")


def test_pushed_file_turns_python_processing_on() -> None:
    config = with_python_file(_config(), {"model.onnx", "preprocessor.py"})
    assert config.processing is not None and config.processing.python == "preprocessor.py"
    assert with_python_file(_config(), {"model.onnx"}).processing is None


def test_python_with_declarative_steps_refused() -> None:
    with pytest.raises(ValueError, match="cannot be combined"):
        _config(python="preprocessor.py", post=[{"kind": "softmax", "input": "y"}])


def test_unset_python_is_not_serialised() -> None:
    dumped = _config(engine_inputs=None).model_dump(mode="json")
    assert "python" not in dumped["processing"]
    assert _config(python="p.py").model_dump(mode="json")["processing"]["python"] == "p.py"


def test_changed_engine_inputs_need_preprocess(tmp_path: Path) -> None:
    config = _config(
        python="preprocessor.py",
        engine_inputs=[{"name": "x", "datatype": "FP16", "shape": [-1, 4]}],
    )
    (tmp_path / "preprocessor.py").write_text("def postprocess(o):\n    return o\n")
    files = {"model.onnx", "preprocessor.py"}
    with pytest.raises(InvalidArgument, match="defines no preprocess"):
        check_processing(config, files, lambda rel: tmp_path / rel)
    (tmp_path / "preprocessor.py").write_text("def preprocess(i):\n    return i\n")
    check_processing(config, files, lambda rel: tmp_path / rel)


def test_named_file_must_be_pushed(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="did not send it"):
        check_processing(_config(python="pre.py"), {"model.onnx"}, lambda rel: tmp_path / rel)
