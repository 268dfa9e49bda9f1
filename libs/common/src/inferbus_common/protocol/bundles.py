"""Bundles: many requests, or many replies, in one bus message.

A gateway sends the requests it takes for one model (and version) within a
short window as one *request bundle* (``IBQ1``); whoever answers them (a
worker after an engine run, a batcher or router refusing them) sends one
*reply bundle* (``IBR1``) per gateway inbox instead of one message per
request. Byte layouts: docs/architecture.md, "Wire formats".

A lone request is a bundle of one: this is the only framing of requests on
``ib.route.<model>`` and ``ib.infer.<model>.<version>``, and reply bundles the
only framing on a gateway's ``<inbox>.b``.

Each request carries a *token*, the gateway's key for the call waiting on
it; replies name the token. Each request's metadata is its `Envelope`.
Frames inside a bundle are ordinary tensor frames
(`inferbus_common.protocol.tensors`), decoded as zero-copy slices of the message.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from inferbus_common.codec import Buffer
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.framing import (
    U32,
    FrameError,
    get_str,
    one_line,
    parts_size,
    put_str,
    split_outputs,
)

REQUEST_BUNDLE_MAGIC = b"IBQ1"
REPLY_BUNDLE_MAGIC = b"IBR1"

# Request entry: token, deadline, held, frame length, priority, mirror token.
_REQUEST = struct.Struct("<QqqIBQ")
# Reply entry: token, queue time (ms), frame length.
_REPLY = struct.Struct("<QfI")


@dataclass(slots=True)
class BundledRequest:
    """One request inside a request bundle: its envelope and this hop's fields.

    Attributes:
        envelope: the request's metadata (shared, never changed in place).
        token: the sender's key for the call waiting on this request; the
            reply names it.
        held_ns: how long the request waited in the sender's open bundle (ns):
            the model's batching delay counts it as time already waited.
        mirror: inbox a copy of the reply also goes to ('' = none; shadow compare).
        mirror_token: the copy's token in `mirror`'s bundles.
        frame: the request's tensor frame (a zero-copy slice after decoding).
    """

    envelope: Envelope
    token: int = 0
    held_ns: int = 0
    mirror: str = ""
    mirror_token: int = 0
    frame: Buffer = b""


@dataclass(slots=True)
class RequestBundle:
    """Requests for one model, all answered through one inbox.

    Attributes:
        model: model name.
        version: the version they go to ('' while the router still has to choose).
        inbox: subject every reply bundle for these requests goes to.
        requests: the requests, in arrival order.
    """

    model: str
    version: str
    inbox: str
    requests: list[BundledRequest]


@dataclass(slots=True)
class BundledReply:
    """One answer inside a reply bundle.

    Attributes:
        token: the request's token.
        status: a `StatusCode` name; '' means OK.
        error: the error message for a person ('' when OK).
        reason: which limit or queue was full, on RESOURCE_EXHAUSTED.
        queue_ms: time the request waited before its engine run.
        frame: the outputs' tensor frame (empty on error).
    """

    token: int
    status: str = ""
    error: str = ""
    reason: str = ""
    queue_ms: float = 0.0
    frame: Buffer = b""


@dataclass(slots=True)
class ReplyBundle:
    """Answers to requests of one gateway, from one engine run or one refusal.

    Attributes:
        version: the version that answered.
        digest: its artifact digest ('' when nothing was computed).
        timings: stage timings shared by every reply, ``Ib-Timings`` format
            without ``queue`` (e.g. ``compute=0.213;post=0.040``).
        batch_rows: rows in the engine run (0 when nothing was computed).
        replies: the answers.
    """

    version: str
    digest: str
    timings: str
    batch_rows: int
    replies: list[BundledReply]


def _attach_frames(
    view: memoryview,
    offset: int,
    items: Sequence[BundledRequest | BundledReply],
    lengths: Sequence[int],
    what: str,
) -> None:
    """Give each item its frame: consecutive slices of `view` from `offset`, to its end."""
    for item, length in zip(items, lengths, strict=True):
        end = offset + length
        if end > view.nbytes:
            raise FrameError(f"a {what}'s frames are truncated")
        item.frame = view[offset:end]
        offset = end
    if offset != view.nbytes:
        raise FrameError(f"{view.nbytes - offset} trailing bytes after a {what}")


def encode_request_bundle(
    model: str,
    version: str,
    inbox: str,
    requests: Sequence[BundledRequest],
    frames: Sequence[Sequence[Buffer]],
) -> bytes:
    """One request bundle; `frames[i]` are the pieces of request i's tensor frame.

    The pieces (e.g. `wire.tensor_frame_parts`, or one slice of a received
    bundle) are joined once, with the header, into the message.
    """
    head: list[Buffer] = [REQUEST_BUNDLE_MAGIC]
    put_str(head, model)
    put_str(head, version)
    put_str(head, inbox)
    head.append(U32.pack(len(requests)))
    pack = _REQUEST.pack
    for r, parts in zip(requests, frames, strict=True):
        e = r.envelope
        head.append(
            pack(r.token, e.deadline_ns, r.held_ns, parts_size(parts), e.priority, r.mirror_token)
        )
        put_str(head, e.request_id)
        put_str(head, ",".join(e.outputs))
        put_str(head, e.traceparent)
        put_str(head, e.tenant)
        put_str(head, e.sticky_key)
        put_str(head, e.version)
        put_str(head, r.mirror)
    for parts in frames:
        head += parts
    return b"".join(head)


def decode_request_bundle(data: Buffer) -> RequestBundle:
    """Decode a request bundle; each request's `frame` is a slice of `data`.

    Raises:
        FrameError: not a request bundle, or truncated.
    """
    view = memoryview(data).cast("B")
    try:
        if bytes(view[:4]) != REQUEST_BUNDLE_MAGIC:
            raise FrameError("not an inferbus request bundle (bad magic)")
        model, offset = get_str(view, 4)
        version, offset = get_str(view, offset)
        inbox, offset = get_str(view, offset)
        (n,) = U32.unpack_from(view, offset)
        offset += 4
        requests: list[BundledRequest] = []
        lengths: list[int] = []
        unpack, size = _REQUEST.unpack_from, _REQUEST.size
        for _ in range(n):
            token, deadline, held, frame_len, priority, mirror_token = unpack(view, offset)
            offset += size
            rid, offset = get_str(view, offset)
            outs, offset = get_str(view, offset)
            tp, offset = get_str(view, offset)
            tenant, offset = get_str(view, offset)
            sticky, offset = get_str(view, offset)
            pin, offset = get_str(view, offset)
            mirror, offset = get_str(view, offset)
            envelope = Envelope(
                rid, model, deadline, pin, priority, split_outputs(outs), tp, tenant, sticky
            )
            requests.append(BundledRequest(envelope, token, held, mirror, mirror_token))
            lengths.append(frame_len)
    except struct.error as exc:
        raise FrameError(f"truncated request bundle: {exc}") from None
    _attach_frames(view, offset, requests, lengths, "request bundle")
    return RequestBundle(model, version, inbox, requests)


def encode_reply_bundle(
    version: str,
    digest: str,
    timings: str,
    batch_rows: int,
    replies: Sequence[BundledReply],
    frames: Sequence[Sequence[Buffer]],
) -> bytes:
    """One reply bundle; `frames[i]` are the pieces of reply i's outputs frame
    (empty for an error), joined once with the header."""
    head: list[Buffer] = [REPLY_BUNDLE_MAGIC]
    put_str(head, version)
    put_str(head, digest)
    put_str(head, timings)
    head.append(U32.pack(batch_rows))
    head.append(U32.pack(len(replies)))
    pack = _REPLY.pack
    for r, parts in zip(replies, frames, strict=True):
        head.append(pack(r.token, r.queue_ms, parts_size(parts)))
        put_str(head, r.status)
        put_str(head, one_line(r.error))
        put_str(head, r.reason)
    for parts in frames:
        head += parts
    return b"".join(head)


def decode_reply_bundle(data: Buffer) -> ReplyBundle:
    """Decode a reply bundle; each reply's `frame` is a slice of `data`.

    Raises:
        FrameError: not a reply bundle, or truncated.
    """
    view = memoryview(data).cast("B")
    try:
        if bytes(view[:4]) != REPLY_BUNDLE_MAGIC:
            raise FrameError("not an inferbus reply bundle (bad magic)")
        version, offset = get_str(view, 4)
        digest, offset = get_str(view, offset)
        timings, offset = get_str(view, offset)
        (batch_rows,) = U32.unpack_from(view, offset)
        (n,) = U32.unpack_from(view, offset + 4)
        offset += 8
        replies: list[BundledReply] = []
        lengths: list[int] = []
        unpack, size = _REPLY.unpack_from, _REPLY.size
        for _ in range(n):
            token, queue_ms, frame_len = unpack(view, offset)
            offset += size
            status, offset = get_str(view, offset)
            error, offset = get_str(view, offset)
            reason, offset = get_str(view, offset)
            replies.append(BundledReply(token, status, error, reason, queue_ms))
            lengths.append(frame_len)
    except struct.error as exc:
        raise FrameError(f"truncated reply bundle: {exc}") from None
    _attach_frames(view, offset, replies, lengths, "reply bundle")
    return ReplyBundle(version, digest, timings, batch_rows, replies)


class ReplyGroups:
    """Replies of one engine run (or one refusal), grouped into one bundle per inbox.

    Args:
        version: the version answering.
        digest: its artifact digest.
        timings: shared stage timings (see `ReplyBundle.timings`).
        batch_rows: rows of the engine run (0 when nothing was computed).
    """

    __slots__ = ("_batch_rows", "_digest", "_groups", "_timings", "_version")

    def __init__(self, version: str, digest: str = "", timings: str = "", batch_rows: int = 0):
        self._version = version
        self._digest = digest
        self._timings = timings
        self._batch_rows = batch_rows
        self._groups: dict[str, tuple[list[BundledReply], list[Sequence[Buffer]]]] = {}

    def add(self, inbox: str, reply: BundledReply, frame: Sequence[Buffer] = ()) -> None:
        """Queue `reply` (with its outputs frame's pieces) for `inbox`."""
        group = self._groups.get(inbox)
        if group is None:
            group = self._groups[inbox] = ([], [])
        group[0].append(reply)
        group[1].append(frame)

    def __len__(self) -> int:
        return sum(len(g[0]) for g in self._groups.values())

    def messages(self) -> Iterator[tuple[str, bytes]]:
        """(inbox, reply bundle) for every inbox that has replies."""
        for inbox, (replies, frames) in self._groups.items():
            yield (
                inbox,
                encode_reply_bundle(
                    self._version, self._digest, self._timings, self._batch_rows, replies, frames
                ),
            )
