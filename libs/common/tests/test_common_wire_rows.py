"""`RowFrames`: per-request reply frames, byte-identical to encoding each row slice."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_common.protocol.tensors import RowFrames, decode_tensors, encode_tensors


def _expected(arrays: dict[str, np.ndarray], names, start: int, stop: int, sliced: bool) -> bytes:
    return encode_tensors(
        [tensor_from_numpy(n, arrays[n][start:stop] if sliced else arrays[n]) for n in names]
    )


ARRAYS = {
    "score": np.arange(16, dtype=np.float32).reshape(8, 2),
    "flat": np.arange(8, dtype=np.int64),
    "cube": np.arange(48, dtype=np.float16).reshape(8, 3, 2),
    "big_endian": np.arange(8, dtype=">i4").reshape(8, 1),
    "strided": np.arange(32, dtype=np.float32).reshape(4, 8).T,
    "text": np.array([f"row{i}".encode() for i in range(8)], dtype=object),
    "empty_rows": np.zeros((0, 3), dtype=np.float32),
}


@pytest.mark.parametrize(
    ("start", "stop"), [(0, 1), (3, 5), (0, 8), (7, 8), (6, 10), (9, 12), (2, 2)]
)
def test_frames_equal_encoding_each_slice(start: int, stop: int) -> None:
    frames = RowFrames(ARRAYS)
    names = list(ARRAYS)
    assert frames.frame(names, start, stop) == _expected(ARRAYS, names, start, stop, True)
    # A subset, in another order, and one name twice.
    subset = ["text", "score", "score"]
    assert frames.frame(subset, start, stop) == _expected(ARRAYS, subset, start, stop, True)


def test_unsliced_frames_hold_whole_tensors_including_scalars() -> None:
    arrays = {**ARRAYS, "scalar": np.float32(3.5) * np.ones((), dtype=np.float32)}
    frames = RowFrames(arrays)
    names = list(arrays)
    body = frames.frame(names, 2, 3, sliced=False)
    assert body == _expected(arrays, names, 2, 3, False)
    assert [t.shape for t in decode_tensors(body)][-1] == ()


def test_data_are_the_rows_of_the_outputs() -> None:
    frames = RowFrames(ARRAYS)
    (t,) = decode_tensors(frames.frame(["strided"], 1, 3))
    np.testing.assert_array_equal(t.as_numpy(), ARRAYS["strided"][1:3])


def test_an_output_without_a_v2_datatype_fails_per_frame() -> None:
    frames = RowFrames({"c": np.zeros((2, 1), dtype=np.complex64)})
    with pytest.raises(InvalidArgument, match="no V2 datatype"):
        frames.frame(["c"], 0, 1)
