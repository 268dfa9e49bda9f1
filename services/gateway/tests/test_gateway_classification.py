"""Triton's classification extension: top classes as "value:index[:label]" strings."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import deserialize_bytes, tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_gateway.triton.classification import class_count, classify, parse_labels


def _texts(t) -> list[str]:
    return [b.decode() for b in deserialize_bytes(t.data)]


def test_top_classes_of_each_row_with_labels() -> None:
    probs = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], np.float32)
    out = classify(tensor_from_numpy("p", probs), 2, ["cat", "dog", "eel"], batched=True)
    assert (out.name, out.datatype, out.shape) == ("p", "BYTES", (2, 2))
    # Best first; the tie keeps the lower index first.
    assert _texts(out) == [
        "0.700000:1:dog",
        "0.200000:2:eel",
        "0.500000:0:cat",
        "0.250000:1:dog",
    ]


def test_without_labels_and_more_classes_than_there_are() -> None:
    scores = np.array([[3, -1, 7]], np.int32)
    out = classify(tensor_from_numpy("s", scores), 10, None, batched=True)
    assert out.shape == (1, 3)
    assert _texts(out) == ["7:2", "3:0", "-1:1"]


def test_a_class_beyond_the_labels_has_no_label() -> None:
    out = classify(
        tensor_from_numpy("p", np.array([[0.1, 0.9]], np.float64)), 1, ["a"], batched=True
    )
    assert _texts(out) == ["0.900000:1"]


def test_unbatched_output_is_one_row() -> None:
    out = classify(tensor_from_numpy("p", np.array([0.2, 0.8], np.float32)), 1, None, batched=False)
    assert out.shape == (1,)
    assert _texts(out) == ["0.800000:1"]


def test_non_numeric_outputs_are_refused() -> None:
    arr = np.empty((1, 1), dtype=object)
    arr[0, 0] = b"x"
    with pytest.raises(InvalidArgument, match="needs a numeric output"):
        classify(tensor_from_numpy("t", arr), 1, None, batched=True)


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True, None])
def test_class_count_is_a_positive_integer(value: object) -> None:
    with pytest.raises(InvalidArgument, match="positive integer"):
        class_count(value, "p")
    assert class_count(3, "p") == 3


def test_labels_file_lines() -> None:
    assert parse_labels(b"cat\n dog \n\n\n", "l.txt") == ["cat", "dog"]
