"""Tensors: the canonical form every service shares, and numpy conversions.

A `Tensor` holds a name, a V2 datatype, a shape and its raw little-endian bytes
(a `bytes` or a zero-copy `memoryview`). Fixed-size tensors become numpy arrays
with `np.frombuffer` (no copy); BYTES tensors use the V2 serialisation: each
element is a 4-byte little-endian length followed by its bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from inferbus_common.datatypes import BYTES, numpy_dtype, v2_datatype
from inferbus_common.errors import InvalidArgument

_LEN = struct.Struct("<I")

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class Tensor:
    """One named tensor in canonical form.

    Attributes:
        name: tensor name as in the model metadata.
        datatype: V2 datatype name (``FP32``, ``BYTES``, ...).
        shape: dimensions; the first is the batch axis for batched models.
        data: raw little-endian bytes (V2 serialisation for BYTES).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Buffer = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Length of the raw data in bytes."""
        return memoryview(self.data).nbytes

    def as_numpy(self) -> np.ndarray:
        """The tensor as a numpy array (a read-only zero-copy view when fixed-size)."""
        return raw_to_numpy(self.data, self.datatype, self.shape)


def element_count(shape: Sequence[int]) -> int:
    """Number of elements for a concrete shape."""
    return math.prod(shape) if shape else 1


def serialize_bytes(values: np.ndarray | Sequence[object]) -> bytes:
    """Serialise BYTES elements (bytes or str) in row-major order as V2 raw data."""
    flat = np.asarray(values, dtype=object).reshape(-1)
    parts: list[bytes] = []
    for item in flat:
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif isinstance(item, np.bytes_ | bytes | bytearray | memoryview):
            item = bytes(item)
        else:
            item = str(item).encode("utf-8")
        parts.append(_LEN.pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def deserialize_bytes(data: Buffer, count: int | None = None) -> list[bytes]:
    """Split V2-serialised BYTES data into its elements.

    Raises:
        InvalidArgument: if the data is truncated or the count does not match.
    """
    view = memoryview(data).cast("B")
    out: list[bytes] = []
    offset, end = 0, view.nbytes
    while offset < end:
        if offset + 4 > end:
            raise InvalidArgument("BYTES tensor data is truncated inside a length prefix")
        (n,) = _LEN.unpack_from(view, offset)
        offset += 4
        if offset + n > end:
            raise InvalidArgument("BYTES tensor data is truncated inside an element")
        out.append(bytes(view[offset : offset + n]))
        offset += n
    if count is not None and len(out) != count:
        raise InvalidArgument(f"BYTES tensor has {len(out)} elements but its shape needs {count}")
    return out


def count_bytes_elements(data: Buffer) -> int:
    """Count the elements of V2-serialised BYTES data, checking it is well formed."""
    view = memoryview(data).cast("B")
    offset, end, count = 0, view.nbytes, 0
    while offset < end:
        if offset + 4 > end:
            raise InvalidArgument("BYTES tensor data is truncated inside a length prefix")
        (n,) = _LEN.unpack_from(view, offset)
        offset += 4 + n
        if offset > end:
            raise InvalidArgument("BYTES tensor data is truncated inside an element")
        count += 1
    return count


def check_raw_size(name: str, datatype: str, shape: Sequence[int], data: Buffer) -> None:
    """Check raw bytes match a shape and datatype.

    Raises:
        InvalidArgument: naming the tensor, the expected and the actual size.
    """
    count = element_count(shape)
    if datatype == BYTES:
        got = count_bytes_elements(data)
        if got != count:
            raise InvalidArgument(
                f"input '{name}': BYTES data holds {got} elements but shape "
                f"{list(shape)} needs {count}"
            )
        return
    expected = count * numpy_dtype(datatype).itemsize
    nbytes = memoryview(data).nbytes
    if nbytes != expected:
        raise InvalidArgument(
            f"input '{name}': raw data is {nbytes} bytes but shape {list(shape)} "
            f"of {datatype} needs {expected} bytes"
        )


def raw_to_numpy(data: Buffer, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """Raw V2 bytes → numpy array; zero-copy (read-only) for fixed-size types."""
    if datatype == BYTES:
        items = deserialize_bytes(data, element_count(shape))
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr.reshape(tuple(shape))
    dtype = numpy_dtype(datatype)
    return np.frombuffer(data, dtype=dtype).reshape(tuple(shape))


def numpy_to_raw(array: np.ndarray) -> tuple[str, tuple[int, ...], bytes | memoryview]:
    """numpy array → (datatype, shape, raw bytes).

    Contiguous little-endian arrays are returned as a memoryview without a copy.
    """
    datatype = v2_datatype(array.dtype)
    shape = tuple(int(d) for d in array.shape)
    if datatype == BYTES:
        return datatype, shape, serialize_bytes(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    array = np.ascontiguousarray(array)
    # Flatten first (a view, no copy): memoryview.cast refuses shapes with a 0 dim.
    return datatype, shape, array.reshape(-1).data.cast("B")


def tensor_from_numpy(name: str, array: np.ndarray) -> Tensor:
    """Build a canonical tensor from a numpy array."""
    datatype, shape, data = numpy_to_raw(array)
    return Tensor(name=name, datatype=datatype, shape=shape, data=data)
