"""Binary message formats on the bus: tensor frames and micro-batches.

Little-endian, length-prefixed, decoded with zero-copy `memoryview` slices.
The byte layouts are specified in docs/architecture.md ("Wire formats");
request and reply bundles are in `inferbus_common.bundles`.

* Tensor frame ``IBT1``: the tensors of one request or reply.
* Micro-batch ``IBB1`` (``IBB2`` when an entry has a mirror subject): entries
  whose replies go one per request to a full subject.
* Micro-batch ``IBB3``: entries that came in request bundles name an inbox
  (from a table at the head of the batch) and a token, and are answered one
  reply bundle per inbox. Encoded only when some entry has a token, so a
  batch of plain requests stays byte-identical to IBB1/IBB2.
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
BATCH_MAGIC_INBOX = b"IBB3"

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_DESC_TAIL = struct.Struct("<BB")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_ENTRY_NUMS = struct.Struct("<qqI")
# IBB3 entry: token, deadline, enqueued, rows, inbox index, mirror inbox index, mirror token.
_ENTRY3 = struct.Struct("<QqqIHHQ")
_NO_INBOX = 0xFFFF
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


def tensor_frame_parts(tensors: Sequence[Tensor]) -> list[Buffer]:
    """The pieces of a tensor frame, in order: joined, they are `encode_tensors`.

    For callers that put frames inside a bigger message (bundles): the tensor
    data are referenced, not copied, until the one join of the whole message.
    """
    parts: list[Buffer] = [TENSOR_MAGIC, _U16.pack(len(tensors))]
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
    parts: list[Buffer] = [TENSOR_MAGIC, _U16.pack(len(first))]
    for i, t in enumerate(first):
        rows = sum(g[i].shape[0] for g in groups)
        nbytes = sum(memoryview(g[i].data).nbytes for g in groups)
        name = t.name.encode("utf-8")
        parts += [
            _U16.pack(len(name)),
            name,
            _DESC_TAIL.pack(DATATYPE_CODES[t.datatype], len(t.shape)),
            struct.pack(f"<{len(t.shape)}q", rows, *t.shape[1:]),
            _U64.pack(nbytes),
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
        return b"".join(self.frame_parts(names, start, stop, sliced=sliced))

    def frame_parts(
        self, names: Sequence[str], start: int, stop: int, *, sliced: bool = True
    ) -> list[Buffer]:
        """The pieces of `frame` (joined, they are the frame), for a message that
        carries several frames and is joined once (a reply bundle)."""
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
        parts += datas
        return parts


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
        reply: where the request's answer goes: the full reply subject when
            `token` is 0, else the inbox of a reply bundle.
        deadline_ns: absolute deadline, unix ns (0 = none).
        enqueued_ns: when the batcher accepted it, unix ns.
        rows: how many rows of the batch belong to this request.
        outputs: requested output names (empty = all).
        traceparent: W3C trace context of the request.
        mirror: where the reply is also sent ('' = none): a subject when
            `mirror_token` is 0, else a reply-bundle inbox.
        token: the request's token in its gateway's reply bundles (0: the
            request came alone and is answered alone, on `reply`).
        mirror_token: the token of the mirror copy in `mirror`'s bundles.
    """

    request_id: str
    reply: str
    deadline_ns: int
    enqueued_ns: int
    rows: int
    outputs: tuple[str, ...] = ()
    traceparent: str = ""
    mirror: str = ""
    token: int = 0
    mirror_token: int = 0


@dataclass(slots=True)
class MicroBatch:
    """Requests batched along axis 0, as carried on the work queue."""

    entries: list[BatchEntry]
    tensors: list[Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Total rows in the batch."""
        return sum(e.rows for e in self.entries)


def _put_str(parts: list[Buffer], value: str) -> None:
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise InvalidArgument("a header string in a micro-batch is longer than 65535 bytes")
    parts.append(_U16.pack(len(raw)))
    parts.append(raw)


def split_outputs(outs: str) -> tuple[str, ...]:
    """Requested output names from their comma-joined form ('' = all)."""
    return tuple(o for o in outs.split(",") if o) if outs else ()


def _get_str(view: memoryview, offset: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(view, offset)
    offset += 2
    return bytes(view[offset : offset + n]).decode("utf-8"), offset + n


def _entry_parts(entries: Sequence[BatchEntry]) -> list[Buffer]:
    """The head of a micro-batch: magic, entries (and IBB3's inbox table)."""
    if any(e.token or e.mirror_token for e in entries):
        return _entry_parts_inbox(entries)
    mirrored = any(e.mirror for e in entries)
    parts: list[Buffer] = [
        BATCH_MAGIC_MIRROR if mirrored else BATCH_MAGIC,
        _U32.pack(len(entries)),
    ]
    for e in entries:
        _put_str(parts, e.request_id)
        _put_str(parts, e.reply)
        parts.append(_ENTRY_NUMS.pack(e.deadline_ns, e.enqueued_ns, e.rows))
        _put_str(parts, ",".join(e.outputs))
        _put_str(parts, e.traceparent)
        if mirrored:
            _put_str(parts, e.mirror)
    return parts


def _entry_parts_inbox(entries: Sequence[BatchEntry]) -> list[Buffer]:
    """IBB3: reply and mirror subjects/inboxes once in a table, entries index it."""
    table: dict[str, int] = {}

    def index(subject: str) -> int:
        if not subject:
            return _NO_INBOX
        i = table.get(subject)
        if i is None:
            i = table[subject] = len(table)
            if i >= _NO_INBOX:
                raise InvalidArgument("a micro-batch names more than 65534 reply inboxes")
        return i

    body: list[Buffer] = [_U32.pack(len(entries))]
    for e in entries:
        body.append(
            _ENTRY3.pack(
                e.token,
                e.deadline_ns,
                e.enqueued_ns,
                e.rows,
                index(e.reply),
                index(e.mirror),
                e.mirror_token,
            )
        )
        _put_str(body, e.request_id)
        _put_str(body, ",".join(e.outputs))
        _put_str(body, e.traceparent)
    head: list[Buffer] = [BATCH_MAGIC_INBOX, _U16.pack(len(table))]
    for subject in table:
        _put_str(head, subject)
    return head + body


def encode_batch(entries: Sequence[BatchEntry], tensors: Sequence[Tensor]) -> bytes:
    """Encode a micro-batch (entries in row order, then the joined tensors)."""
    return b"".join(_entry_parts(entries) + tensor_frame_parts(tensors))


def encode_joined_batch(entries: Sequence[BatchEntry], groups: Sequence[Sequence[Tensor]]) -> bytes:
    """Encode a micro-batch from each entry's own tensors, joining them along axis 0.

    One copy: the request buffers go straight into the message's single join
    (same bytes as ``encode_batch(entries, join_tensors(groups))``).
    """
    return b"".join(_entry_parts(entries) + joined_frame_parts(groups))


def _decode_entries_inbox(view: memoryview) -> tuple[list[BatchEntry], int]:
    (count,) = _U16.unpack_from(view, 4)
    offset = 6
    table = []
    for _ in range(count):
        subject, offset = _get_str(view, offset)
        table.append(subject)
    (n,) = _U32.unpack_from(view, offset)
    offset += 4
    entries = []
    unpack = _ENTRY3.unpack_from
    size = _ENTRY3.size
    for _ in range(n):
        token, deadline, enqueued, rows, reply_i, mirror_i, mirror_token = unpack(view, offset)
        offset += size
        rid, offset = _get_str(view, offset)
        outs, offset = _get_str(view, offset)
        tp, offset = _get_str(view, offset)
        try:
            reply = table[reply_i] if reply_i != _NO_INBOX else ""
            mirror = table[mirror_i] if mirror_i != _NO_INBOX else ""
        except IndexError:
            raise FrameError("a micro-batch entry names an inbox outside its table") from None
        entries.append(
            BatchEntry(
                rid,
                reply,
                deadline,
                enqueued,
                rows,
                split_outputs(outs),
                tp,
                mirror,
                token,
                mirror_token,
            )
        )
    return entries, offset


def decode_batch(data: Buffer) -> MicroBatch:
    """Decode a micro-batch (IBB1, IBB2 or IBB3); tensor data are zero-copy slices."""
    view = memoryview(data).cast("B")
    try:
        magic = bytes(view[:4])
        if magic == BATCH_MAGIC_INBOX:
            entries, offset = _decode_entries_inbox(view)
        elif magic == BATCH_MAGIC or magic == BATCH_MAGIC_MIRROR:
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
                        rid, reply, deadline, enqueued, rows, split_outputs(outs), tp, mirror
                    )
                )
        else:
            raise FrameError("not an inferbus micro-batch (bad magic)")
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


def batch_signature(tensors: Sequence[Tensor]) -> tuple[object, ...]:
    """Key under which requests can share a batch: names, datatypes, non-batch dims."""
    return tuple((t.name, t.datatype, t.shape[1:]) for t in tensors)
