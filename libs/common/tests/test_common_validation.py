"""`RequestChecker`: validation that remembers passing layouts, with the same errors."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import Tensor, deserialize_bytes, serialize_bytes, tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.validation import RequestChecker


def _config(**extra: object) -> ModelConfig:
    return ModelConfig(
        name="fraud",
        max_batch_size=8,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        outputs=[{"name": "score", "datatype": "FP32", "shape": [-1, 1]}],
        **extra,
    )


def _x(rows: int, cols: int = 4, dtype: type = np.float32) -> Tensor:
    return tensor_from_numpy("x", np.zeros((rows, cols), dtype=dtype))


def _errors(fn, *args: object) -> str | None:
    try:
        fn(*args)
    except InvalidArgument as exc:
        return exc.message
    return None


@pytest.mark.parametrize(
    ("tensors", "outputs"),
    [
        ([_x(1, 5)], ()),
        ([_x(9)], ()),
        ([_x(1, dtype=np.float64)], ()),
        ([Tensor("x", "FP32", (1, 4), b"\x00" * 12)], ()),
        ([_x(1), _x(1)], ()),
        ([tensor_from_numpy("y", np.zeros((1, 4), dtype=np.float32))], ()),
        ([_x(1)], ("logits",)),
    ],
)
def test_refusals_match_validate_request_even_after_a_layout_passed(
    tensors: list[Tensor], outputs: tuple[str, ...]
) -> None:
    config = _config()
    checker = RequestChecker(config)
    checker.check([_x(1)])
    checker.check([_x(2)], ("score",))
    expected = _errors(config.validate_request, tensors, outputs)
    assert expected is not None
    # Twice: a refused layout is never remembered as passing.
    assert _errors(checker.check, tensors, outputs) == expected
    assert _errors(checker.check, tensors, outputs) == expected


def test_same_shape_with_wrong_byte_count_is_still_refused() -> None:
    checker = RequestChecker(_config())
    checker.check([_x(1)])
    with pytest.raises(InvalidArgument, match="raw data is 12 bytes"):
        checker.check([Tensor("x", "FP32", (1, 4), b"\x00" * 12)])


def test_outputs_are_part_of_the_layout() -> None:
    checker = RequestChecker(_config())
    checker.check([_x(1)], ("score",))
    with pytest.raises(InvalidArgument, match="unknown output 'other'"):
        checker.check([_x(1)], ("other",))


def test_passing_layouts_are_bounded() -> None:
    checker = RequestChecker(_config(), max_layouts=2)
    for rows in range(1, 9):
        checker.check([_x(rows)])
    assert len(checker._passed) == 2
    with pytest.raises(InvalidArgument, match="exceeds max_batch_size"):
        checker.check([_x(9)])


def test_bytes_inputs_are_checked_every_time() -> None:
    # BYTES checks read the data (element counts, lengths) and may truncate in place.
    config = ModelConfig(
        name="text",
        max_batch_size=8,
        inputs=[
            {
                "name": "s",
                "datatype": "BYTES",
                "shape": [-1],
                "max_element_bytes": 3,
                "truncate": True,
            }
        ],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1]}],
    )
    checker = RequestChecker(config)
    for _ in range(2):
        t = Tensor("s", "BYTES", (2,), serialize_bytes([b"ab", b"abcdef"]))
        checker.check([t])
        assert deserialize_bytes(t.data) == [b"ab", b"abc"]
    with pytest.raises(InvalidArgument, match="BYTES data holds 1 elements"):
        checker.check([Tensor("s", "BYTES", (2,), serialize_bytes([b"ab"]))])
