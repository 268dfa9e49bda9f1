"""Tensor frames (``IBT1``): the tensors of one request or reply.

Little-endian, length-prefixed, decoded with zero-copy `memoryview` slices.
The byte layout is specified in docs/architecture.md ("Wire formats"). A
frame travels inside a request bundle, a reply bundle or a micro-batch
(`inferbus_common.protocol.bundles`, `.microbatch`), never alone on a
request subject.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from inferbus_common.codec import Buffer, Tensor, numpy_to_raw, tensor_from_numpy
from inferbus_common.datatypes import CODE_DATATYPES, DATATYPE_CODES
from inferbus_common.errors import InvalidArgument
from inferbus_common.protocol.framing import I64, U16, U64, FrameError

TENSOR_MAGIC = b"IBT1"

_DESC_TAIL = struct.Struct("<BB")
_MAX_NDIM = 32


def _descriptor(t: Tensor) -> list[bytes]:
    """A tensor's descriptor in a frame: name, datatype, shape, data size."""
    name = t.name.encode("utf-8")
    return [
        U16.pack(len(name)),
        name,
        _DESC_TAIL.pack(DATATYPE_CODES[t.datatype], len(t.shape)),
        struct.pack(f"<{len(t.shape)}q", *t.shape),
        U64.pack(memoryview(t.data).nbytes),
    ]


def tensor_frame_parts(tensors: Sequence[Tensor]) -> list[Buffer]:
    """The pieces of a tensor frame, in order: joined, they are `encode_tensors`.

    For callers that put frames inside a bigger message (bundles): the tensor
    data are referenced, not copied, until the one join of the whole message.
    """
    parts: list[Buffer] = [TENSOR_MAGIC, U16.pack(len(tensors))]
    for t in tensors:
        parts += _descriptor(t)
    parts += [t.data for t in tensors]
    return parts


def encode_tensors(tensors: Sequence[Tensor]) -> bytes:
    """Encode tensors as one tensor frame."""
    return b"".join(tensor_frame_parts(tensors))


def joined_frame_parts(groups: Sequence[Sequence[Tensor]]) -> list[Buffer]:
    """The pieces of one tensor frame holding `groups` joined along axis 0.

    Every group (one request's tensors) has the same names, datatypes and
    non-batch dims in the same order (`batch_signature`). Nothing is copied:
    the data blocks are the groups' own buffers, for the caller's single join.
    """
    first = groups[0]
    parts: list[Buffer] = [TENSOR_MAGIC, U16.pack(len(first))]
    for i, t in enumerate(first):
        rows = sum(g[i].shape[0] for g in groups)
        nbytes = sum(memoryview(g[i].data).nbytes for g in groups)
        name = t.name.encode("utf-8")
        parts += [
            U16.pack(len(name)),
            name,
            _DESC_TAIL.pack(DATATYPE_CODES[t.datatype], len(t.shape)),
            struct.pack(f"<{len(t.shape)}q", rows, *t.shape[1:]),
            U64.pack(nbytes),
        ]
    for i in range(len(first)):
        parts += [g[i].data for g in groups]
    return parts


class RowFrames:
    """Tensor frames of row ranges of the same arrays: one reply body per request.

    Built once per batch from the engine's outputs (first axis = rows): each
    array's descriptor and little-endian bytes are prepared once, so the
    frame of rows ``[start, stop)`` is a few slices and a join instead of a
    numpy conversion and a full encode per request. Frames are byte-identical
    to ``encode_tensors`` of `tensor_from_numpy` of the row slices (BYTES and
    0-d arrays take that path per frame).

    Args:
        arrays: name → array, in the order frames list them by default.
    """

    __slots__ = ("_arrays", "_fixed")

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self._arrays = arrays
        # name → (descriptor head, packed dims after the first, rows, bytes per row, raw)
        self._fixed: dict[str, tuple[bytes, bytes, int, int, memoryview]] = {}
        for name, arr in arrays.items():
            if arr.ndim == 0 or arr.dtype.kind in "OSU":
                continue
            try:
                datatype, shape, data = numpy_to_raw(arr)
            except InvalidArgument:
                continue  # no V2 datatype: each frame raises it, as encoding the slice does
            raw = memoryview(data)
            encoded = name.encode("utf-8")
            head = b"".join(
                [
                    U16.pack(len(encoded)),
                    encoded,
                    _DESC_TAIL.pack(DATATYPE_CODES[datatype], len(shape)),
                ]
            )
            rest = struct.pack(f"<{len(shape) - 1}q", *shape[1:])
            rows = shape[0]
            self._fixed[name] = (head, rest, rows, raw.nbytes // rows if rows else 0, raw)

    def frame(self, names: Sequence[str], start: int, stop: int, *, sliced: bool = True) -> bytes:
        """The tensor frame of `names` (each in `arrays`), rows ``[start, stop)``.

        With ``sliced=False`` every tensor is whole (a model without a batch axis).
        """
        return b"".join(self.frame_parts(names, start, stop, sliced=sliced))

    def frame_parts(
        self, names: Sequence[str], start: int, stop: int, *, sliced: bool = True
    ) -> list[Buffer]:
        """The pieces of `frame` (joined, they are the frame), for a message that
        carries several frames and is joined once (a reply bundle)."""
        parts: list[Buffer] = [TENSOR_MAGIC, U16.pack(len(names))]
        datas: list[Buffer] = []
        for name in names:
            fixed = self._fixed.get(name)
            if fixed is None:
                arr = self._arrays[name]
                t = tensor_from_numpy(name, arr[start:stop] if sliced else arr)
                parts += _descriptor(t)
                datas.append(t.data)
                continue
            head, rest, rows, row_bytes, raw = fixed
            if sliced:
                # Numpy's clipping of arr[start:stop] for start, stop >= 0.
                lo = min(start, rows)
                hi = max(lo, min(stop, rows))
                data = raw[lo * row_bytes : hi * row_bytes]
            else:
                lo, hi, data = 0, rows, raw
            parts.append(head)
            parts.append(I64.pack(hi - lo))
            parts.append(rest)
            parts.append(U64.pack(data.nbytes))
            datas.append(data)
        parts += datas
        return parts


def decode_tensors_at(view: memoryview, offset: int) -> tuple[list[Tensor], int]:
    """The tensor frame starting at `offset` of `view`, and the offset after it.

    Raises:
        FrameError: bad magic, truncated, or an unknown datatype.
    """
    try:
        if bytes(view[offset : offset + 4]) != TENSOR_MAGIC:
            raise FrameError("not an inferbus tensor frame (bad magic)")
        offset += 4
        (count,) = U16.unpack_from(view, offset)
        offset += 2
        descs: list[tuple[str, str, tuple[int, ...], int]] = []
        for _ in range(count):
            (nlen,) = U16.unpack_from(view, offset)
            offset += 2
            name = bytes(view[offset : offset + nlen]).decode("utf-8")
            offset += nlen
            code, ndim = _DESC_TAIL.unpack_from(view, offset)
            offset += 2
            if ndim > _MAX_NDIM:
                raise FrameError(f"tensor '{name}' has {ndim} dimensions")
            dims = struct.unpack_from(f"<{ndim}q", view, offset)
            offset += 8 * ndim
            (nbytes,) = U64.unpack_from(view, offset)
            offset += 8
            try:
                datatype = CODE_DATATYPES[code]
            except KeyError:
                raise FrameError(f"tensor '{name}' has unknown datatype code {code}") from None
            descs.append((name, datatype, tuple(dims), nbytes))
        tensors = []
        for name, datatype, dims, nbytes in descs:
            if offset + nbytes > view.nbytes:
                raise FrameError(f"tensor '{name}' data is truncated")
            tensors.append(Tensor(name, datatype, dims, view[offset : offset + nbytes]))
            offset += nbytes
        return tensors, offset
    except struct.error as exc:
        raise FrameError(f"truncated tensor frame: {exc}") from None
    except UnicodeDecodeError as exc:
        raise FrameError(f"tensor name is not valid UTF-8: {exc}") from None


def decode_tensors(data: Buffer) -> list[Tensor]:
    """Decode a tensor frame; tensor data are zero-copy slices of `data`."""
    view = memoryview(data).cast("B")
    tensors, end = decode_tensors_at(view, 0)
    if end != view.nbytes:
        raise FrameError(f"{view.nbytes - end} trailing bytes after tensor frame")
    return tensors


def join_tensors(per_request: Iterable[Sequence[Tensor]]) -> list[Tensor]:
    """Concatenate requests' tensors along axis 0 from their bytes.

    All requests must have the same tensor names, datatypes and non-batch
    dimensions, in the same order (the batcher groups by `batch_signature`).
    """
    groups = list(per_request)
    first = groups[0]
    out = []
    for i, t in enumerate(first):
        rows = sum(g[i].shape[0] for g in groups)
        data = b"".join(g[i].data for g in groups)
        out.append(Tensor(t.name, t.datatype, (rows, *t.shape[1:]), data))
    return out


def batch_signature(tensors: Sequence[Tensor]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """Key under which requests can share a batch: names, datatypes, non-batch dims."""
    return tuple((t.name, t.datatype, t.shape[1:]) for t in tensors)
