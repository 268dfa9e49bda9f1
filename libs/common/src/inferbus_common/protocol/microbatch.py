"""Micro-batches (``IBB3``): requests batched along axis 0, batcher → worker.

The one format on the work queue. Every entry names its reply inbox (from a
table at the head of the batch, each gateway inbox once) and its token in
that gateway's reply bundles; a shadowed entry names the mirror inbox and
token likewise. The worker answers one reply bundle per inbox
(`inferbus_common.protocol.bundles`). Byte layout: docs/architecture.md
("Wire formats").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferbus_common.codec import Buffer, Tensor
from inferbus_common.protocol.framing import (
    U16,
    U32,
    FrameError,
    get_str,
    put_str,
    split_outputs,
)
from inferbus_common.protocol.tensors import decode_tensors_at, joined_frame_parts

BATCH_MAGIC = b"IBB3"

# Entry: token, deadline, enqueued, rows, inbox index, mirror inbox index, mirror token.
_ENTRY = struct.Struct("<QqqIHHQ")
_NO_INBOX = 0xFFFF


@dataclass(slots=True)
class BatchEntry:
    """One request inside a micro-batch.

    Attributes:
        request_id: the request's id (for logs and de-duplication).
        reply: the gateway inbox its reply bundle goes to ('' = nobody waits).
        deadline_ns: absolute deadline, unix ns (0 = none).
        enqueued_ns: when the batcher accepted it, unix ns.
        rows: how many rows of the batch belong to this request.
        outputs: requested output names (empty = all).
        traceparent: W3C trace context of the request.
        mirror: the inbox a copy of the reply also goes to ('' = none; shadow compare).
        token: the request's token in its gateway's reply bundles.
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


def _entry_parts(entries: Sequence[BatchEntry]) -> list[Buffer]:
    """The head of a micro-batch: magic, the inbox table, the entries."""
    table: dict[str, int] = {}

    def index(subject: str) -> int:
        if not subject:
            return _NO_INBOX
        i = table.get(subject)
        if i is None:
            i = table[subject] = len(table)
            if i >= _NO_INBOX:
                raise FrameError("a micro-batch names more than 65534 reply inboxes")
        return i

    body: list[Buffer] = [U32.pack(len(entries))]
    pack = _ENTRY.pack
    for e in entries:
        body.append(
            pack(
                e.token,
                e.deadline_ns,
                e.enqueued_ns,
                e.rows,
                index(e.reply),
                index(e.mirror),
                e.mirror_token,
            )
        )
        put_str(body, e.request_id)
        put_str(body, ",".join(e.outputs))
        put_str(body, e.traceparent)
    head: list[Buffer] = [BATCH_MAGIC, U16.pack(len(table))]
    for subject in table:
        put_str(head, subject)
    return head + body


def encode_joined_batch(entries: Sequence[BatchEntry], groups: Sequence[Sequence[Tensor]]) -> bytes:
    """Encode a micro-batch from each entry's own tensors, joined along axis 0.

    `groups[i]` are entry i's tensors (same names, datatypes and non-batch
    dims for all, `tensors.batch_signature`). One copy: the request buffers go
    straight into the message's single join.

    Raises:
        FrameError: a string field over 65,535 bytes, or too many inboxes.
    """
    return b"".join(_entry_parts(entries) + joined_frame_parts(groups))


def decode_batch(data: Buffer) -> MicroBatch:
    """Decode a micro-batch; tensor data are zero-copy slices of `data`.

    Raises:
        FrameError: not a micro-batch, truncated, an entry naming an inbox
            outside the table, or trailing bytes.
    """
    view = memoryview(data).cast("B")
    if bytes(view[:4]) != BATCH_MAGIC:
        raise FrameError("not an inferbus micro-batch (bad magic)")
    try:
        (count,) = U16.unpack_from(view, 4)
        offset = 6
        table = []
        for _ in range(count):
            subject, offset = get_str(view, offset)
            table.append(subject)
        (n,) = U32.unpack_from(view, offset)
        offset += 4
        entries = []
        unpack, size = _ENTRY.unpack_from, _ENTRY.size
        for _ in range(n):
            token, deadline, enqueued, rows, reply_i, mirror_i, mirror_token = unpack(view, offset)
            offset += size
            rid, offset = get_str(view, offset)
            outs, offset = get_str(view, offset)
            tp, offset = get_str(view, offset)
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
    except struct.error as exc:
        raise FrameError(f"truncated micro-batch header: {exc}") from None
    tensors, end = decode_tensors_at(view, offset)
    if end != view.nbytes:
        raise FrameError(f"{view.nbytes - end} trailing bytes after micro-batch")
    return MicroBatch(entries, tensors)
