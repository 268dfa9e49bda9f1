"""KServe V2 tensor datatypes and their numpy equivalents.

The mapping is a table and its inverse. ``BYTES`` has no fixed-size numpy
dtype: on the wire each element is a 4-byte little-endian length followed by
that many bytes; in numpy it is an ``object`` array of ``bytes``.
"""

from __future__ import annotations

import numpy as np

from inferbus_common.errors import InvalidArgument

BYTES = "BYTES"

#: V2 datatype name → numpy dtype (little-endian), for fixed-size types.
V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

#: numpy dtype → V2 datatype name (the inverse table).
NUMPY_TO_V2: dict[np.dtype, str] = {v: k for k, v in V2_TO_NUMPY.items()}

#: Every datatype name the platform accepts.
ALL_DATATYPES: frozenset[str] = frozenset([*V2_TO_NUMPY, BYTES])

#: Compact one-byte codes used in bus frames (stable: append only).
DATATYPE_CODES: dict[str, int] = {
    name: i
    for i, name in enumerate(
        [
            "BOOL",
            "UINT8",
            "UINT16",
            "UINT32",
            "UINT64",
            "INT8",
            "INT16",
            "INT32",
            "INT64",
            "FP16",
            "FP32",
            "FP64",
            "BYTES",
        ]
    )
}
CODE_DATATYPES: dict[int, str] = {v: k for k, v in DATATYPE_CODES.items()}

#: V2 datatype name → Triton model-configuration ``DataType`` name (``TYPE_FP32``...).
V2_TO_CONFIG: dict[str, str] = {
    **{name: f"TYPE_{name}" for name in V2_TO_NUMPY},
    BYTES: "TYPE_STRING",
}

#: Triton model-configuration ``DataType`` name → V2 datatype name (the inverse table).
CONFIG_TO_V2: dict[str, str] = {v: k for k, v in V2_TO_CONFIG.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype for a fixed-size V2 datatype.

    Raises:
        InvalidArgument: for an unknown datatype or for BYTES.
    """
    try:
        return V2_TO_NUMPY[datatype]
    except KeyError:
        if datatype == BYTES:
            raise InvalidArgument("BYTES tensors have no fixed-size numpy dtype") from None
        raise InvalidArgument(
            f"unknown datatype {datatype!r}; expected one of {sorted(ALL_DATATYPES)}"
        ) from None


def v2_datatype(dtype: np.dtype) -> str:
    """V2 datatype name for a numpy dtype (object/bytes/str arrays → BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return BYTES
    name = NUMPY_TO_V2.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    if name is None:
        raise InvalidArgument(f"numpy dtype {dtype} has no V2 datatype")
    return name


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (BYTES → 0, variable)."""
    if datatype == BYTES:
        return 0
    return numpy_dtype(datatype).itemsize
