"""Binary message formats on the bus: tensor frames and micro-batches.

Both are little-endian, length-prefixed and decoded with zero-copy
`memoryview` slices, so the router never touches a body and the batcher joins
tensor bytes along the batch axis without turning them into numpy.

Tensor frame (request body, reply body, and the tensors of a micro-batch)::

    b"IBT1" | u16 count | count x descriptor | data blocks in descriptor order
    descriptor = u16 name_len | name (utf-8) | u8 datatype code | u8 ndim
                 | ndim x i64 dims | u64 nbytes

Micro-batch (one JetStream message)::

    b"IBB1" | u32 n | n x entry | tensor frame (dims[0] = sum of rows)
    entry = str request_id | str reply_subject | i64 deadline_ns
            | i64 enqueued_ns | u32 rows | str outputs | str traceparent
    str = u16 length | utf-8 bytes

Entries are in row order: request i owns rows [offset_i, offset_i + rows_i).

A micro-batch in which some entry has a mirror subject (shadow comparison,
``Ib-Mirror``) starts with ``b"IBB2"`` instead, and each entry ends with one
more ``str mirror_subject``; batches without one stay byte-identical to IBB1.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferbus_common.codec import Buffer, Tensor, numpy_to_raw, tensor_from_numpy
from inferbus_common.datatypes import CODE_DATATYPES, DATATYPE_CODES
from inferbus_common.errors import InvalidArgument

TENSOR_MAGIC = b"IBT1"
BATCH_MAGIC = b"IBB1"
BATCH_MAGIC_MIRROR = b"IBB2"

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_DESC_TAIL = struct.Struct("<BB")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_ENTRY_NUMS = struct.Struct("<qqI")
_MAX_NDIM = 32


class FrameError(InvalidArgument):
    """A bus message is not in the expected binary format."""


def _descriptor(t: Tensor) -> list[bytes]:
    """A tensor's descriptor in a frame: name, datatype, shape, data size."""
    name = t.name.encode("utf-8")
    return [
        _U16.pack(len(name)),
        name,
        _DESC_TAIL.pack(DATATYPE_CODES[t.datatype], len(t.shape)),
        struct.pack(f"<{len(t.shape)}q", *t.shape),
        _U64.pack(memoryview(t.data).nbytes),
    ]


def encode_tensors(tensors: Sequence[Tensor]) -> bytes:
    """Encode tensors as one tensor frame."""
    head: list[bytes] = [TENSOR_MAGIC, _U16.pack(len(tensors))]
    datas: list[Buffer] = []
    for t in tensors:
        head += _descriptor(t)
        datas.append(t.data)
    return b"".join([*head, *datas])


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
                    _U16.pack(len(encoded)),
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
        parts: list[Buffer] = [TENSOR_MAGIC, _U16.pack(len(names))]
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
            parts.append(_I64.pack(hi - lo))
            parts.append(rest)
            parts.append(_U64.pack(data.nbytes))
            datas.append(data)
        return b"".join([*parts, *datas])


def _decode_tensors_at(view: memoryview, offset: int) -> tuple[list[Tensor], int]:
    try:
        if bytes(view[offset : offset + 4]) != TENSOR_MAGIC:
            raise FrameError("not an inferbus tensor frame (bad magic)")
        offset += 4
        (count,) = _U16.unpack_from(view, offset)
        offset += 2
        descs: list[tuple[str, str, tuple[int, ...], int]] = []
        for _ in range(count):
            (nlen,) = _U16.unpack_from(view, offset)
            offset += 2
            name = bytes(view[offset : offset + nlen]).decode("utf-8")
            offset += nlen
            code, ndim = _DESC_TAIL.unpack_from(view, offset)
            offset += 2
            if ndim > _MAX_NDIM:
                raise FrameError(f"tensor '{name}' has {ndim} dimensions")
            dims = struct.unpack_from(f"<{ndim}q", view, offset)
            offset += 8 * ndim
            (nbytes,) = _U64.unpack_from(view, offset)
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
    tensors, end = _decode_tensors_at(view, 0)
    if end != view.nbytes:
        raise FrameError(f"{view.nbytes - end} trailing bytes after tensor frame")
    return tensors


@dataclass(slots=True)
class BatchEntry:
    """One request inside a micro-batch.

    Attributes:
        request_id: the request's id (for logs and de-duplication).
        reply: subject the request's answer goes to.
        deadline_ns: absolute deadline, unix ns (0 = none).
        enqueued_ns: when the batcher accepted it, unix ns.
        rows: how many rows of the batch belong to this request.
        outputs: requested output names (empty = all).
        traceparent: W3C trace context of the request.
        mirror: subject the reply is also published to ('' = none).
    """

    request_id: str
    reply: str
    deadline_ns: int
    enqueued_ns: int
    rows: int
    outputs: tuple[str, ...] = ()
    traceparent: str = ""
    mirror: str = ""


@dataclass(slots=True)
class MicroBatch:
    """Requests batched along axis 0, as carried on the work queue."""

    entries: list[BatchEntry]
    tensors: list[Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Total rows in the batch."""
        return sum(e.rows for e in self.entries)


def _put_str(parts: list[bytes], value: str) -> None:
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise InvalidArgument("a header string in a micro-batch is longer than 65535 bytes")
    parts.append(_U16.pack(len(raw)))
    parts.append(raw)


def _get_str(view: memoryview, offset: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(view, offset)
    offset += 2
    return bytes(view[offset : offset + n]).decode("utf-8"), offset + n


def encode_batch(entries: Sequence[BatchEntry], tensors: Sequence[Tensor]) -> bytes:
    """Encode a micro-batch (entries in row order, then the joined tensors)."""
    mirrored = any(e.mirror for e in entries)
    magic = BATCH_MAGIC_MIRROR if mirrored else BATCH_MAGIC
    parts: list[bytes] = [magic, _U32.pack(len(entries))]
    for e in entries:
        _put_str(parts, e.request_id)
        _put_str(parts, e.reply)
        parts.append(_ENTRY_NUMS.pack(e.deadline_ns, e.enqueued_ns, e.rows))
        _put_str(parts, ",".join(e.outputs))
        _put_str(parts, e.traceparent)
        if mirrored:
            _put_str(parts, e.mirror)
    parts.append(encode_tensors(tensors))
    return b"".join(parts)


def decode_batch(data: Buffer) -> MicroBatch:
    """Decode a micro-batch; tensor data are zero-copy slices of `data`."""
    view = memoryview(data).cast("B")
    try:
        magic = bytes(view[:4])
        if magic != BATCH_MAGIC and magic != BATCH_MAGIC_MIRROR:
            raise FrameError("not an inferbus micro-batch (bad magic)")
        (n,) = _U32.unpack_from(view, 4)
        offset = 8
        entries = []
        for _ in range(n):
            rid, offset = _get_str(view, offset)
            reply, offset = _get_str(view, offset)
            deadline, enqueued, rows = _ENTRY_NUMS.unpack_from(view, offset)
            offset += _ENTRY_NUMS.size
            outs, offset = _get_str(view, offset)
            tp, offset = _get_str(view, offset)
            mirror = ""
            if magic == BATCH_MAGIC_MIRROR:
                mirror, offset = _get_str(view, offset)
            entries.append(
                BatchEntry(
                    rid,
                    reply,
                    deadline,
                    enqueued,
                    rows,
                    tuple(o for o in outs.split(",") if o),
                    tp,
                    mirror,
                )
            )
    except (struct.error, UnicodeDecodeError) as exc:
        raise FrameError(f"truncated micro-batch header: {exc}") from None
    tensors, end = _decode_tensors_at(view, offset)
    if end != view.nbytes:
        raise FrameError(f"{view.nbytes - end} trailing bytes after micro-batch")
    return MicroBatch(entries, tensors)


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


def batch_signature(tensors: Sequence[Tensor]) -> tuple:
    """Key under which requests can share a batch: names, datatypes, non-batch dims."""
    return tuple((t.name, t.datatype, t.shape[1:]) for t in tensors)
