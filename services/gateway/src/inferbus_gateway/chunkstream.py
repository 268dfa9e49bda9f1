"""One generative request's chunks at the gateway, back in ``Ib-Seq`` order.

`GenerationDispatcher` (``generation.py``) hands each chunk that arrives for a
request, on its own or out of a chunk frame, to that request's `ChunkStream`;
`GenerationCall.chunks` reads them from it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

from inferbus_common.errors import DeadlineExceeded, Unavailable
from inferbus_common.generation import GenerationChunk
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_from_reply, error_headers
from inferbus_gateway.genmetrics import GEN_GAPS


class ChunkMessage(Protocol):
    """A message on a stream's inbox: a chunk of its own, or the router's error."""

    @property
    def headers(self) -> dict[str, str] | None: ...

    @property
    def data(self) -> bytes: ...


_Piece = tuple[int, bool, str, dict[str, str] | None, bytes]
"""What a stream holds of a message: (Ib-Seq, -1 for none; final; version; the
headers when they may carry an error, None for a chunk of a frame; body)."""


class ChunkStream:
    """One request's chunks, reordered by ``Ib-Seq``.

    A stream waits on one future that `feed` resolves, and one timer for its
    whole deadline; a per-chunk ``asyncio.timeout`` and queue cost a few
    microseconds of every token (bench/findings.md, round 20).

    Args:
        window: out-of-order chunks held while waiting for a missing one.
        gap_timeout_s: how long a missing chunk may be waited for once later ones came.

    Attributes:
        version: the version that answers (from the first chunk's ``Ib-Version``).
    """

    def __init__(self, window: int = 32, gap_timeout_s: float = 2.0) -> None:
        self._ready: collections.deque[_Piece] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._expired = False
        """The deadline's timer fired (a wait after it needs a new one)."""
        self._window = window
        self._gap_timeout_s = gap_timeout_s
        self.direct: tuple[str, str] | None = None
        """(model, version) when the request went straight to that version's workers
        (`GenerationDispatcher.publish_to_workers`), else None (through the router)."""
        self.version = ""
        self.received = False
        """Whether any message came (then a worker, or the router, holds the request)."""

    def feed(self, msg: ChunkMessage) -> None:
        """Called by the dispatcher for a message of its own on this request's inbox."""
        headers = msg.headers or {}
        seq_text = headers.get(h.SEQ)
        try:
            seq = -1 if seq_text is None else int(seq_text)
        except ValueError:
            seq = -1
        final = headers.get(h.FINAL) == "1"
        self._push((seq, final, headers.get(h.VERSION, ""), headers, msg.data))

    def feed_framed(self, seq: int, final: bool, version: str, data: bytes) -> None:
        """Called by the dispatcher for this request's chunk of a chunk frame."""
        self._push((seq, final, version, None, data))

    def feed_error(self, exc: BaseException) -> None:
        """End the stream with `exc` (as the router's error message would)."""
        self._push((-1, True, "", error_headers(exc), b""))

    def _push(self, piece: _Piece) -> None:
        self.received = True
        self._ready.append(piece)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        self._expired = True
        self._wake()

    async def _next(self, timeout_s: float | None) -> tuple[_Piece | None, bool]:
        """The next piece, and whether it had to be waited for; (None, True) when
        woken without one (the deadline's timer, or `timeout_s`)."""
        if self._ready:
            return self._ready.popleft(), False
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, self._wake)
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return (self._ready.popleft() if self._ready else None), True

    async def chunks(self, deadline_ns: int) -> AsyncIterator[GenerationChunk]:
        """Yield chunks in order until the final one.

        Raises:
            InferbusError: the error a chunk (or the router) carried.
            DeadlineExceeded: the deadline passed first.
            Unavailable: a gap in the sequence, or a malformed chunk.
        """
        expected = 0
        held: dict[int, _Piece] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(max(0.0, h.remaining_s(deadline_ns)), self._expire)
        try:
            while True:
                piece = held.pop(expected, None)
                waited = False
                if piece is None:
                    remaining = h.remaining_s(deadline_ns)
                    if remaining <= 0:
                        raise DeadlineExceeded("the generation passed its deadline")
                    if self._expired:  # fired a little early (clocks): arm it again
                        self._expired = False
                        deadline = loop.call_later(remaining + 0.001, self._expire)
                    gap_wait = min(remaining, self._gap_timeout_s) if held else None
                    piece, waited = await self._next(gap_wait)
                    if piece is None:
                        if held:
                            GEN_GAPS.inc()
                            raise Unavailable(
                                f"the stream lost chunk {expected} (later chunks arrived); "
                                "the answer is incomplete, retry the request"
                            )
                        continue  # woken by the deadline's timer: re-checked above
                    seq, _, _, headers, _ = piece
                    if seq < 0:
                        # Not a chunk: an error from the router (no route, not found...).
                        err = error_from_reply(headers)
                        raise err or Unavailable("an unexpected message arrived on the stream")
                    if seq < expected or seq in held:
                        continue  # a duplicate
                    if seq > expected:
                        held[seq] = piece
                        if len(held) > self._window:
                            GEN_GAPS.inc()
                            raise Unavailable(
                                f"the stream lost chunk {expected}; the answer is incomplete, "
                                "retry the request"
                            )
                        continue
                expected += 1
                _, final, version, headers, data = piece
                if headers is not None:
                    err = error_from_reply(headers)
                    if err is not None:
                        raise err
                try:
                    chunk = GenerationChunk.decode(data)
                except ValueError:
                    raise Unavailable("a worker sent a malformed chunk; see its logs") from None
                if not self.version:
                    self.version = version
                yield chunk
                if final:
                    return
                if not waited:
                    # Taken without waiting: let other streams run.
                    await asyncio.sleep(0)
        finally:
            deadline.cancel()
