"""The `config.json` schema and request validation (`inferbus_common.modelconfig`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from inferbus_common.codec import Tensor, serialize_bytes, tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig

GOLDEN = Path(__file__).parent / "data" / "config_fraud.json"


def _golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture
def config() -> ModelConfig:
    return ModelConfig.model_validate_json(GOLDEN.read_bytes())


def _request(rows: int = 2, cols: int = 4) -> list[Tensor]:
    return [
        tensor_from_numpy("features", np.zeros((rows, cols), dtype=np.float32)),
        Tensor("merchant", "BYTES", (rows, 1), serialize_bytes([f"m{i}" for i in range(rows)])),
    ]


def test_golden_config_parses_with_its_values(config: ModelConfig) -> None:
    assert config.name == "fraud"
    assert config.max_batch_size == 8
    assert [s.name for s in config.inputs] == ["features", "merchant"]
    assert config.engine.providers == ["cuda", "cpu"]
    assert config.engine.inter_op_threads == 1  # default
    assert config.batching.preferred_batch_sizes == [4, 8]
    assert config.batching.default_timeout_ms == 30_000  # default
    assert (config.instance_count, config.pool) == (2, "gpu")
    assert config.input_spec("merchant") is not None
    assert config.input_spec("nope") is None
    # Serialising and reading back gives the same config.
    assert ModelConfig.model_validate_json(config.model_dump_json()) == config


def test_minimal_config_gets_defaults() -> None:
    config = ModelConfig.model_validate(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        }
    )
    assert (config.name, config.file, config.pool, config.max_batch_size) == (
        "",
        "model.onnx",
        "default",
        32,
    )
    assert config.engine.kind == "onnxruntime"
    assert config.engine.providers == ["cpu"]


def _with(path: str, value: Any) -> dict[str, Any]:
    data = _golden()
    target = data
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    last = keys[-1]
    target[int(last) if last.isdigit() else last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("inputs.0.datatype", "FP8", "unknown datatype 'FP8'"),
        ("inputs.0.shape", [-1, 0], r"dimensions must be positive or -1"),
        ("inputs.0.shape", [-1, -2], r"dimensions must be positive or -1"),
        ("inputs.0.shape", [4, 4], "first dimension is the batch axis and must be -1"),
        ("outputs.1.shape", [], "first dimension is the batch axis and must be -1"),
        ("inputs.1.name", "features", "input names must be unique"),
        ("inputs.0.name", "", "at least 1 character"),
        ("inputs", [], "at least 1 item"),
        ("max_batch_size", -1, "greater than or equal to 0"),
        ("batching.default_priority", 3, "default_priority must be within 1..priority_levels"),
        ("batching.max_queue_size", 0, "greater than or equal to 1"),
        ("engine.kind", "tflite", "onnxruntime"),
        ("engine.providers", ["rocm"], "cpu"),
        ("instance_count", 0, "greater than or equal to 1"),
        ("surprise", True, "Extra inputs are not permitted"),
    ],
)
def test_invalid_configs_are_rejected(path: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig.model_validate(_with(path, value))


def test_without_batching_shapes_are_literal() -> None:
    config = ModelConfig.model_validate(
        {
            "max_batch_size": 0,
            "inputs": [{"name": "x", "datatype": "INT32", "shape": [2, 2]}],
            "outputs": [{"name": "y", "datatype": "INT32", "shape": [2]}],
        }
    )
    config.validate_request([tensor_from_numpy("x", np.zeros((2, 2), dtype=np.int32))])
    with pytest.raises(InvalidArgument, match=r"has shape \[3, 2\], expected \[2, 2\]"):
        config.validate_request([tensor_from_numpy("x", np.zeros((3, 2), dtype=np.int32))])


def test_valid_request_passes(config: ModelConfig) -> None:
    config.validate_request(_request(rows=1))
    config.validate_request(_request(rows=8), outputs=["score"])
    config.validate_request(list(reversed(_request())), outputs=["score", "label"])


def _bad(*tensors: Tensor) -> list[Tensor]:
    return list(tensors)


def _features(shape: tuple[int, ...], dtype: type = np.float32) -> Tensor:
    return tensor_from_numpy("features", np.zeros(shape, dtype=dtype))


def _merchant(rows: int) -> Tensor:
    return Tensor("merchant", "BYTES", (rows, 1), serialize_bytes(["m"] * rows))


@pytest.mark.parametrize(
    ("tensors", "outputs", "message"),
    [
        (
            [_features((1, 4)), _features((1, 4)), _merchant(1)],
            (),
            r"^fraud: an input is given more than once$",
        ),
        (
            [_features((1, 4)), _merchant(1), tensor_from_numpy("extra", np.zeros(1))],
            (),
            r"^fraud: unknown input\(s\) \['extra'\]; expected \['features', 'merchant'\]$",
        ),
        ([_features((1, 4))], (), r"^fraud: missing input\(s\) \['merchant'\]$"),
        (
            [_features((1, 4), np.float64), _merchant(1)],
            (),
            r"^fraud: input 'features' has datatype FP64, expected FP32$",
        ),
        (
            [_features((1, 5)), _merchant(1)],
            (),
            r"^fraud: input 'features' has shape \[1, 5\], expected \[-1, 4\]$",
        ),
        (
            [_features((4,)), _merchant(1)],
            (),
            r"^fraud: input 'features' has shape \[4\], expected \[-1, 4\]$",
        ),
        (
            [Tensor("features", "FP32", (-1, 4), b""), _merchant(1)],
            (),
            r"^fraud: input 'features' has a negative dimension$",
        ),
        (
            [_features((2, 4)), _merchant(3)],
            (),
            r"^fraud: inputs disagree on the batch size \(2 vs 3\)$",
        ),
        (
            [Tensor("features", "FP32", (1, 4), b"\x00" * 12), _merchant(1)],
            (),
            r"^input 'features': raw data is 12 bytes but shape \[1, 4\] of FP32 needs 16 bytes$",
        ),
        (
            [_features((1, 4)), Tensor("merchant", "BYTES", (2, 1), serialize_bytes(["m"]))],
            (),
            "inputs disagree on the batch size",
        ),
        (
            [_features((1, 4)), Tensor("merchant", "BYTES", (1, 1), serialize_bytes(["m", "n"]))],
            (),
            r"^input 'merchant': BYTES data holds 2 elements but shape \[1, 1\] needs 1$",
        ),
        ([_features((0, 4)), _merchant(0)], (), r"^fraud: batch size must be at least 1$"),
        ([_features((9, 4)), _merchant(9)], (), r"^fraud: batch size 9 exceeds max_batch_size 8$"),
        (
            [_features((1, 4)), _merchant(1)],
            ("score", "logits"),
            r"^fraud: unknown output 'logits'; expected \['label', 'score'\]$",
        ),
    ],
)
def test_invalid_requests_say_what_is_wrong(
    config: ModelConfig, tensors: list[Tensor], outputs: tuple[str, ...], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        config.validate_request(tensors, outputs)


def test_unnamed_model_is_called_model() -> None:
    data = _golden()
    data["name"] = ""
    config = ModelConfig.model_validate(data)
    with pytest.raises(InvalidArgument, match=r"^model: missing input"):
        config.validate_request([])
