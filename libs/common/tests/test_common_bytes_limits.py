"""BYTES input limits declared in config.json: refuse or truncate long elements."""

from __future__ import annotations

import pytest

from inferbus_common.codec import Tensor, deserialize_bytes, serialize_bytes
from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig


def _config(**spec: object) -> ModelConfig:
    return ModelConfig(
        name="text",
        inputs=[{"name": "s", "datatype": "BYTES", "shape": [-1], **spec}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1]}],
    )


def _tensor(*items: bytes) -> Tensor:
    return Tensor("s", "BYTES", (len(items),), serialize_bytes(list(items)))


def test_long_element_is_refused_with_the_limit() -> None:
    cfg = _config(max_element_bytes=4)
    cfg.validate_request([_tensor(b"abcd")])
    with pytest.raises(InvalidArgument, match="element of 6 bytes; the limit is 4"):
        cfg.validate_request([_tensor(b"ab", b"abcdef")])


def test_long_element_is_truncated_when_configured() -> None:
    cfg = _config(max_element_bytes=4, truncate=True)
    t = _tensor(b"ab", b"abcdef")
    cfg.validate_request([t])
    assert deserialize_bytes(t.data) == [b"ab", b"abcd"]


@pytest.mark.parametrize(
    "spec",
    [
        {"truncate": True},
    ],
)
def test_truncate_needs_a_limit(spec: dict) -> None:
    with pytest.raises(ValueError, match="truncate needs max_element_bytes"):
        _config(**spec)


def test_limits_apply_to_bytes_only() -> None:
    with pytest.raises(ValueError, match="BYTES only"):
        ModelConfig(
            inputs=[{"name": "x", "datatype": "FP32", "shape": [-1], "max_element_bytes": 3}],
            outputs=[{"name": "y", "datatype": "FP32", "shape": [-1]}],
        )
