"""Unary KServe V2 calls that the gRPC edge (``services/edge``) carries over NATS.

The edge terminates gRPC outside Python and publishes each unary call of
``inference.GRPCInferenceService`` as one NATS request on ``<prefix>.edge.grpc``
(queue group ``gateway``): the request's protobuf bytes as the body, the method,
deadline, peer and text metadata as headers. Here a gateway process decodes the
body exactly as its own gRPC port does (`tolerant`: an undecodable request is
INVALID_ARGUMENT), runs the same servicer method with an `EdgeContext` standing
in for grpc.aio's, and answers with the response bytes, or with the status and
trailing metadata. An edge that asks for them (``Ib-Reply-Frames``) gets its
answers in reply frames: those ready at one moment (a bundle's requests come back
together) go out as one message (`ReplyFrames`); otherwise each answer goes on its
call's own reply subject with headers. The contracts are in
``services/edge/main.go``, ``services/edge/replies.go`` and docs/architecture.md.

Why: grpc.aio accepts one call per method at a time, re-armed through the event
loop, so a loop that also runs the pipeline and NATS caps one connection's call
rate (bench/findings.md, rounds 14-15). NATS delivers many requests per read and
spreads them over every gateway process of the queue group.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common import bus
from inferbus_gateway.grpc_api.tolerant import SERVICE, unary_methods

log = logging.getLogger(__name__)

METHOD = "Ib-Method"
TIMEOUT_US = "Ib-Timeout-Us"
PEER = "Ib-Peer"
STATUS = "Ib-Status"
MESSAGE = "Ib-Message"
REPLY_FRAMES = "Ib-Reply-Frames"
QUEUE = "gateway"
RECORD = struct.Struct("<QHII")
"""A reply frame's record head: call id, gRPC status, meta length, body length."""
CLAIM_EVERY_S = 0.25
"""How often a gateway claims, to each edge, the calls it has held longer than
this (``services/edge/replies.go``, "Claims"): an edge answers UNAVAILABLE a call
no gateway has claimed for its orphan time (1 s), instead of letting it wait out
the client's deadline when the gateway that took it was killed or froze."""


class EdgeAbort(grpc.aio.AbortError):
    """Raised by `EdgeContext.abort`, as grpc.aio's context raises AbortError."""


class EdgeContext:
    """The part of ``grpc.aio.ServicerContext`` the servicer uses, for a call that
    came over the edge.

    Args:
        metadata: the call's text metadata (lowercase keys).
        timeout_s: the client's remaining deadline when the edge sent it (None: none).
        peer: the client's address as the edge saw it.
    """

    def __init__(self, metadata: dict[str, str], timeout_s: float | None, peer: str) -> None:
        self._metadata = tuple(metadata.items())
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._peer = peer
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailers: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The call's text metadata, as (key, value) pairs."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline (None: no deadline)."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        """The client's address (``ipv4:host:port`` as grpc names it)."""
        return self._peer

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Trailing metadata sent with the answer (retry-after, inferbus-reason)."""
        self.trailers = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with a status: raises, as grpc.aio's abort does."""
        self.code = code
        self.details = details
        raise EdgeAbort()


Handler = Callable[[Any, EdgeContext], Awaitable[Any]]


def _single_line(text: str) -> str:
    """A header value: NATS headers end at a line break."""
    return " ".join(text.splitlines())


class EdgeListener:
    """Serves the edge's calls on one gateway process.

    Args:
        nc: the gateway's NATS connection.
        subject: ``Subjects.edge_grpc()``.
        servicer: the gateway's `GRPCInferenceServicer` (each unary method is looked
            up on it by name).
        max_in_flight: calls served at once by this process; more wait in the
            subscription (the edge's deadline still runs).
        reply_frames: answer an edge that asks for it (``Ib-Reply-Frames``) with
            reply frames; off: every answer on its call's own subject.
    """

    def __init__(
        self,
        nc: Client,
        subject: str,
        servicer: Any,
        *,
        max_in_flight: int,
        reply_frames: bool = True,
    ) -> None:
        self._nc = nc
        self._frames = ReplyFrames(nc) if reply_frames else None
        self._subject = subject
        self._methods: dict[str, tuple[Callable[[bytes], Any], Handler]] = {
            f"/{SERVICE}/{name}": pair for name, pair in unary_methods(servicer).items()
        }
        self._slots = asyncio.Semaphore(max_in_flight)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None
        self._held: dict[str, dict[int, float]] = {}
        """Claims subject of an edge -> its calls here -> when each arrived."""
        self._claimer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Join the queue group: from now on the edge may hand this process calls."""
        self._sub = await self._nc.subscribe(
            self._subject, queue=QUEUE, cb=self._on_msg, pending_msgs_limit=-1
        )
        self._claimer = asyncio.get_running_loop().create_task(self._claim_loop())

    async def stop(self, timeout_s: float) -> None:
        """Leave the queue group, then let the calls already taken finish.

        `bus.leave`, not an unsubscribe: calls nats-server routed here before it
        saw the unsubscribe are still on the wire, and an unsubscribed client
        would drop them (the edge would answer them UNAVAILABLE after
        ``-orphan-after``). Its round trips take them all in first.
        """
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await asyncio.wait_for(bus.leave(sub), timeout_s)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("leaving the edge's queue group: %s", exc or type(exc).__name__)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        if self._frames is not None:
            await self._frames.flushed(timeout_s)
        if self._claimer is not None:
            self._claimer.cancel()
            self._claimer = None

    async def _on_msg(self, msg: Msg) -> None:
        held = self._hold(msg)
        await self._slots.acquire()
        task = asyncio.get_running_loop().create_task(self._serve(msg, held))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    def _hold(self, msg: Msg) -> tuple[str, int] | None:
        """Note a call as held here, for the claims (None: its edge takes none)."""
        frames = (msg.headers or {}).get(REPLY_FRAMES, "")
        call_id = _call_id(msg.reply or "")
        if call_id is None or not frames.endswith(".r"):
            return None
        claims = frames[:-1] + "k"
        self._held.setdefault(claims, {})[call_id] = time.monotonic()
        return claims, call_id

    def _release(self, held: tuple[str, int]) -> None:
        claims, call_id = held
        calls = self._held.get(claims)
        if calls is not None:
            calls.pop(call_id, None)
            if not calls:
                del self._held[claims]

    async def _claim_loop(self) -> None:
        """Every `CLAIM_EVERY_S`, claim to each edge the calls held longer than that."""
        while True:
            await asyncio.sleep(CLAIM_EVERY_S)
            older = time.monotonic() - CLAIM_EVERY_S
            per_message = max(1, self._nc.max_payload // 8 - 1)
            for claims, calls in list(self._held.items()):
                ids = [call_id for call_id, since in calls.items() if since <= older]
                for i in range(0, len(ids), per_message):
                    part = ids[i : i + per_message]
                    try:
                        await self._nc.publish(claims, struct.pack(f"<{len(part)}Q", *part))
                    except Exception as exc:  # the edge then answers them UNAVAILABLE
                        log.warning("could not claim %d edge calls: %s", len(part), exc)

    async def _serve(self, msg: Msg, held: tuple[str, int] | None = None) -> None:
        try:
            await self._answer(msg)
        finally:
            if held is not None:
                self._release(held)

    async def _answer(self, msg: Msg) -> None:
        headers = msg.headers or {}
        method = headers.get(METHOD, "")
        context = EdgeContext(
            {k: v for k, v in headers.items() if k.islower()},
            _timeout_s(headers.get(TIMEOUT_US)),
            headers.get(PEER, ""),
        )
        body = b""
        found = self._methods.get(method)
        try:
            if found is None:
                await context.abort(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"{method or 'a call without a method'} is not a unary method of {SERVICE}",
                )
            else:
                deserialize, handler = found
                response = await handler(deserialize(msg.data), context)
                body = response.SerializeToString()
        except grpc.aio.AbortError:
            pass
        except Exception:  # the servicer maps its own errors; this is a bug
            log.exception("unhandled error serving an edge call of %s", method)
            context.code, context.details = grpc.StatusCode.INTERNAL, "internal error"
        if not msg.reply:
            return
        frames = headers.get(REPLY_FRAMES)
        if frames and self._frames is not None:
            call_id = _call_id(msg.reply)
            if call_id is not None:
                self._frames.add(frames, call_id, context, body)
                return
        reply_headers = {k: _single_line(v) for k, v in context.trailers}
        if context.code is not grpc.StatusCode.OK:
            reply_headers[STATUS] = str(context.code.value[0])
            reply_headers[MESSAGE] = _single_line(context.details)
        try:
            await self._nc.publish(msg.reply, body, headers=reply_headers or None)
        except Exception as exc:  # the edge's wait then ends at the deadline
            log.warning("could not answer an edge call of %s: %s", method, exc)


def _call_id(reply: str) -> int | None:
    """The call id an edge put last in its reply subject (``<inbox>.c.<id>``)."""
    _, _, last = reply.rpartition(".")
    if not last.isdigit() or len(last) > 20:
        return None
    call_id = int(last)
    return call_id if call_id < 1 << 64 else None


def pack_answer(call_id: int, context: EdgeContext, body: bytes) -> bytes:
    """One record of a reply frame (the layout is in ``services/edge/replies.go``)."""
    code = context.code.value[0]
    if code == 0 and not context.trailers:
        return RECORD.pack(call_id, 0, 0, len(body)) + body
    lines = [_single_line(context.details) if code else ""]
    lines += [f"{k}:{_single_line(v)}" for k, v in context.trailers]
    meta = "\n".join(lines).encode()
    return RECORD.pack(call_id, code, len(meta), len(body)) + meta + body


class _Frame:
    """The records of one reply frame being gathered, and their size in bytes."""

    __slots__ = ("records", "size")

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.size = 0

    def take(self) -> list[bytes]:
        """The records gathered so far; the frame starts empty again."""
        records, self.records, self.size = self.records, [], 0
        return records


class ReplyFrames:
    """Gathers the answers ready at one moment for one edge into one message.

    The answers to a bundle's requests come back in one reply and finish their
    calls in the same turn of the event loop; each is added here, and the frame
    goes out once that turn's ready callbacks have run (``call_soon``), or at
    once when the next answer would take it past the bus's ``max_payload``.

    Args:
        nc: the gateway's NATS connection.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._open: dict[str, _Frame] = {}
        self._sending: set[asyncio.Task[None]] = set()

    @property
    def _limit(self) -> int:
        return max(1024, self._nc.max_payload - 1024)

    def add(self, subject: str, call_id: int, context: EdgeContext, body: bytes) -> None:
        """Queue one call's answer for the frame going to `subject`."""
        record = pack_answer(call_id, context, body)
        limit = self._limit
        if len(record) > limit:
            too_big = EdgeContext({}, None, "")
            too_big.code = grpc.StatusCode.RESOURCE_EXHAUSTED
            too_big.details = (
                f"the answer is {len(body)} bytes, more than the bus carries (max_payload "
                f"{self._nc.max_payload}); call the gateway's own gRPC port for answers this large"
            )
            record = pack_answer(call_id, too_big, b"")
        frame = self._open.get(subject)
        if frame is None:
            frame = self._open[subject] = _Frame()
            asyncio.get_running_loop().call_soon(self._flush, subject)
        elif frame.size + len(record) > limit:
            self._send(subject, frame.take())
        frame.records.append(record)
        frame.size += len(record)

    def _flush(self, subject: str) -> None:
        frame = self._open.pop(subject, None)
        if frame is not None and frame.records:
            self._send(subject, frame.take())

    def _send(self, subject: str, records: list[bytes]) -> None:
        task = asyncio.ensure_future(self._publish(subject, b"".join(records), len(records)))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _publish(self, subject: str, data: bytes, answers: int) -> None:
        try:
            await self._nc.publish(subject, data)
        except Exception as exc:  # the edge's waits then end at their deadlines
            log.warning("could not send %d answers to the edge: %s", answers, exc)

    async def flushed(self, timeout_s: float) -> None:
        """Wait until the frames handed to the connection have been published."""
        for subject in list(self._open):
            self._flush(subject)
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=timeout_s)


def _timeout_s(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, int(value) / 1e6)
    except ValueError:
        return None
