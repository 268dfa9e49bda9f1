"""The ONNX graph must match the tensors config.json declares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from onnx import TensorProto

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_registry.onnxcheck import check_onnx


def _config(config_for: Callable[..., dict[str, object]], **overrides: object) -> ModelConfig:
    return ModelConfig.model_validate({"name": "tiny", **config_for(**overrides)})


def test_matching_model_passes(
    tmp_path: Path, onnx_writer: Callable[..., Path], config_for: Callable[..., dict[str, object]]
) -> None:
    check_onnx(onnx_writer(tmp_path / "m.onnx"), _config(config_for))


def test_fixed_config_dim_accepts_symbolic_model_dim(
    tmp_path: Path, onnx_writer: Callable[..., Path], config_for: Callable[..., dict[str, object]]
) -> None:
    config = _config(
        config_for,
        max_batch_size=0,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4, 64]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [4, 2]}],
    )
    check_onnx(onnx_writer(tmp_path / "m.onnx"), config)


@pytest.mark.parametrize(
    ("onnx_args", "config_overrides", "message"),
    [
        (
            {"in_name": "features"},
            {},
            r"input 'x' is not an input of the ONNX model.*\['features'\]",
        ),
        ({"out_name": "score"}, {}, r"output 'y' is not an output of the ONNX model"),
        ({"elem_type": TensorProto.DOUBLE}, {}, r"input 'x' is FP32 in config.json but FP64"),
        ({"features": 32}, {}, r"input 'x' dimension 1 is 64 in config.json but 32"),
        ({"batch": 1}, {}, r"input 'x' dimension 0 is -1 in config.json but 1"),
        (
            {},
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8, 8]}]},
            r"input 'x' has rank 3 in config.json",
        ),
        (
            {},
            {"outputs": [{"name": "y", "datatype": "INT64", "shape": [-1, 2]}]},
            r"output 'y' is INT64 in config.json but FP32",
        ),
    ],
)
def test_mismatches_are_named(
    tmp_path: Path,
    onnx_writer: Callable[..., Path],
    config_for: Callable[..., dict[str, object]],
    onnx_args: dict[str, object],
    config_overrides: dict[str, object],
    message: str,
) -> None:
    path = onnx_writer(tmp_path / "m.onnx", **onnx_args)
    with pytest.raises(InvalidArgument, match=message):
        check_onnx(path, _config(config_for, **config_overrides))


def test_garbage_is_not_an_onnx_model(
    tmp_path: Path, config_for: Callable[..., dict[str, object]]
) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\x00\x01 definitely not protobuf \xff" * 10)
    with pytest.raises(InvalidArgument, match=r"not a valid ONNX model|ONNX checker"):
        check_onnx(path, _config(config_for))
