"""Canonical tensors, V2 datatypes and numpy conversions (`codec`, `datatypes`)."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import (
    Tensor,
    check_raw_size,
    count_bytes_elements,
    deserialize_bytes,
    element_count,
    numpy_to_raw,
    raw_to_numpy,
    serialize_bytes,
    tensor_from_numpy,
)
from inferbus_common.datatypes import (
    ALL_DATATYPES,
    BYTES,
    CODE_DATATYPES,
    DATATYPE_CODES,
    NUMPY_TO_V2,
    V2_TO_NUMPY,
    element_size,
    numpy_dtype,
    v2_datatype,
)
from inferbus_common.errors import InvalidArgument

FIXED = sorted(V2_TO_NUMPY)


def _sample(datatype: str) -> np.ndarray:
    dtype = V2_TO_NUMPY[datatype]
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    info = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    return np.array([[info.min, 0, 1], [2, info.max, 3]], dtype=dtype)


def test_tables_are_inverse_and_complete() -> None:
    assert ALL_DATATYPES == {*V2_TO_NUMPY, BYTES}
    assert {NUMPY_TO_V2[d]: d for d in NUMPY_TO_V2} == V2_TO_NUMPY
    assert set(DATATYPE_CODES) == ALL_DATATYPES
    assert {v: k for k, v in CODE_DATATYPES.items()} == DATATYPE_CODES


def test_frame_codes_are_stable() -> None:
    # Codes are on the wire: changing one breaks every running service.
    assert DATATYPE_CODES == {
        "BOOL": 0, "UINT8": 1, "UINT16": 2, "UINT32": 3, "UINT64": 4, "INT8": 5,
        "INT16": 6, "INT32": 7, "INT64": 8, "FP16": 9, "FP32": 10, "FP64": 11, "BYTES": 12,
    }  # fmt: skip


@pytest.mark.parametrize("datatype", FIXED)
def test_fixed_size_round_trip(datatype: str) -> None:
    array = _sample(datatype)
    got_type, shape, raw = numpy_to_raw(array)
    assert got_type == datatype
    assert shape == (2, 3)
    assert memoryview(raw).nbytes == 6 * element_size(datatype)
    back = raw_to_numpy(raw, datatype, shape)
    assert back.dtype == V2_TO_NUMPY[datatype]
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("datatype", [d for d in FIXED if V2_TO_NUMPY[d].itemsize > 1])
def test_big_endian_input_becomes_little_endian(datatype: str) -> None:
    array = _sample(datatype)
    big = array.astype(array.dtype.newbyteorder(">"))
    got_type, _, raw = numpy_to_raw(big)
    assert got_type == datatype
    assert bytes(raw) == array.astype(V2_TO_NUMPY[datatype]).tobytes()


def test_contiguous_arrays_are_not_copied() -> None:
    array = np.arange(10, dtype=np.float32)
    _, _, raw = numpy_to_raw(array)
    assert isinstance(raw, memoryview)
    assert np.shares_memory(np.frombuffer(raw, dtype=np.float32), array)
    back = raw_to_numpy(raw, "FP32", (10,))
    assert np.shares_memory(back, array)


def test_non_contiguous_arrays_are_made_contiguous() -> None:
    array = np.arange(6, dtype=np.int16).reshape(2, 3).T
    datatype, shape, raw = numpy_to_raw(array)
    assert (datatype, shape) == ("INT16", (3, 2))
    np.testing.assert_array_equal(raw_to_numpy(raw, datatype, shape), array)


def test_raw_to_numpy_from_bytes_is_read_only() -> None:
    back = raw_to_numpy(np.arange(3, dtype=np.int32).tobytes(), "INT32", (3,))
    assert not back.flags.writeable


def test_scalar_tensor() -> None:
    t = tensor_from_numpy("s", np.array(3.5, dtype=np.float64))
    assert (t.datatype, t.shape, t.nbytes) == ("FP64", (), 8)
    assert t.as_numpy() == 3.5
    assert element_count(()) == 1


def test_bytes_serialisation_format() -> None:
    raw = serialize_bytes(["ab", b"", "é"])
    assert raw == b"\x02\x00\x00\x00ab" + b"\x00\x00\x00\x00" + b"\x02\x00\x00\x00\xc3\xa9"
    assert deserialize_bytes(raw) == [b"ab", b"", "é".encode()]
    assert count_bytes_elements(raw) == 3


def test_bytes_tensor_round_trip() -> None:
    values = np.array([[b"a", b"bc"], ["ünï", ""]], dtype=object)
    t = tensor_from_numpy("t", values)
    assert (t.datatype, t.shape) == (BYTES, (2, 2))
    back = t.as_numpy()
    assert back.dtype == object
    assert back.tolist() == [[b"a", b"bc"], ["ünï".encode(), b""]]
    # numpy fixed-width bytes and str arrays are BYTES too.
    assert numpy_to_raw(np.array([b"x", b"yz"]))[0] == BYTES
    assert tensor_from_numpy("u", np.array(["x", "yz"])).as_numpy().tolist() == [b"x", b"yz"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x01\x00", "truncated inside a length prefix"),
        (b"\x05\x00\x00\x00abc", "truncated inside an element"),
    ],
)
def test_truncated_bytes_data(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        deserialize_bytes(raw)
    with pytest.raises(InvalidArgument, match=message):
        count_bytes_elements(raw)


def test_bytes_count_mismatch() -> None:
    with pytest.raises(InvalidArgument, match="has 1 elements but its shape needs 2"):
        raw_to_numpy(serialize_bytes(["a"]), BYTES, (2,))


def test_check_raw_size_accepts_matching_data() -> None:
    check_raw_size("x", "FP32", (2, 3), b"\x00" * 24)
    check_raw_size("s", BYTES, (2,), serialize_bytes(["a", "b"]))
    check_raw_size("e", "INT8", (0, 5), b"")


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "message"),
    [
        ("FP32", (2, 3), b"\x00" * 20,
         r"input 'x': raw data is 20 bytes but shape \[2, 3\] of FP32 needs 24 bytes"),
        ("FP16", (4,), b"\x00" * 10, r"is 10 bytes but shape \[4\] of FP16 needs 8 bytes"),
        (BYTES, (3,), serialize_bytes(["a", "b"]), r"input 'x': BYTES data holds 2 elements but "
         r"shape \[3\] needs 3"),
        (BYTES, (1,), b"\x09\x00\x00\x00a", "truncated inside an element"),
        ("COMPLEX", (1,), b"", "unknown datatype 'COMPLEX'"),
    ],
)  # fmt: skip
def test_check_raw_size_errors(
    datatype: str, shape: tuple[int, ...], raw: bytes, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_raw_size("x", datatype, shape, raw)


def test_datatype_lookup_errors() -> None:
    with pytest.raises(InvalidArgument, match="BYTES tensors have no fixed-size numpy dtype"):
        numpy_dtype(BYTES)
    with pytest.raises(InvalidArgument, match="unknown datatype 'FP8'"):
        numpy_dtype("FP8")
    with pytest.raises(InvalidArgument, match="has no V2 datatype"):
        v2_datatype(np.dtype(np.complex64))
    assert element_size(BYTES) == 0
    assert element_size("FP16") == 2


def test_tensor_nbytes_from_any_buffer() -> None:
    raw = bytearray(12)
    assert Tensor("a", "INT32", (3,), raw).nbytes == 12
    assert Tensor("a", "INT32", (3,), memoryview(raw)).nbytes == 12


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)])
def test_empty_arrays_convert(shape: tuple[int, ...]) -> None:
    # An empty batch is legal; memoryview.cast alone refuses shapes with a 0 dim.
    t = tensor_from_numpy("e", np.zeros(shape, dtype=np.float32))
    assert (t.datatype, t.shape, t.nbytes) == ("FP32", shape, 0)
    assert t.as_numpy().shape == shape
