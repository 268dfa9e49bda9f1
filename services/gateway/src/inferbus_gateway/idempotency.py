"""Retries of the same request are not computed twice.

A client that retries a request with the same id (after a timeout or a lost
connection) gets the first attempt's answer: joined while it is in flight,
replayed from a short-lived cache once answered. The key includes a hash of
the inputs, so a client that reuses one id for different requests is never
served someone else's answer. Only successful answers are cached; errors are
recomputed (most are cheap and retrying is the point). Per gateway instance.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace

from prometheus_client import Counter

from inferbus_common.sequences import encode_sequence_id
from inferbus_gateway.canonical import InferRequest, InferResponse

REPLAYED = Counter(
    "inferbus_gateway_idempotent_replays_total",
    "Requests answered from an earlier attempt with the same id and inputs.",
    ["kind"],
)


def request_key(request: InferRequest) -> str:
    """Identity of a request: model, version, id, requested outputs, sequence and input bytes."""
    h = hashlib.blake2b(digest_size=16)
    seq = request.sequence
    sequence = f"{encode_sequence_id(seq.id)}|{seq.flags}" if seq is not None else ""
    for part in (request.model, request.version, request.id, ",".join(request.outputs), sequence):
        h.update(part.encode())
        h.update(b"\0")
    for t in request.inputs:
        h.update(f"{t.name}|{t.datatype}|{t.shape}".encode())
        h.update(t.data)
    return h.hexdigest()


def _own_copy(response: InferResponse) -> InferResponse:
    """A copy whose lists and maps the caller may change: the steps after this one
    replace outputs in place (classification) and set shared-memory outputs, which
    must not reach the cached answer or another attempt's copy of it."""
    return replace(
        response,
        outputs=list(response.outputs),
        timings_ms=dict(response.timings_ms),
        shm_outputs=dict(response.shm_outputs),
    )


class IdempotencyCache:
    """In-flight join and short replay window for requests that carry an id.

    Args:
        window_s: how long a successful answer is kept for replay.
        max_entries: bound on cached answers (oldest dropped first).
        clock: monotonic clock (injectable for tests).
    """

    def __init__(
        self,
        window_s: float = 30.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window_s
        self._max = max_entries
        self._clock = clock
        self._inflight: dict[str, asyncio.Future[InferResponse]] = {}
        self._done: OrderedDict[str, tuple[float, InferResponse]] = OrderedDict()

    async def run(
        self, request: InferRequest, compute: Callable[[], Awaitable[InferResponse]]
    ) -> InferResponse:
        """Answer `request` with `compute()` unless an identical attempt exists."""
        if not request.id or self._window <= 0:
            return await compute()
        key = request_key(request)
        now = self._clock()
        cached = self._done.get(key)
        if cached is not None:
            if now - cached[0] <= self._window:
                REPLAYED.labels("cached").inc()
                return _own_copy(cached[1])
            del self._done[key]
        pending = self._inflight.get(key)
        if pending is not None:
            REPLAYED.labels("joined").inc()
            try:
                return _own_copy(await asyncio.shield(pending))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if pending.cancelled() and task is not None and not task.cancelling():
                    # The first attempt's client went away; this one still wants an answer.
                    return await compute()
                raise
        fut: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            response = await compute()
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            # Mark retrieved: there may be no joiner, and that is fine.
            fut.exception()
            raise
        else:
            kept = _own_copy(response)
            fut.set_result(kept)
            self._done[key] = (self._clock(), kept)
            while len(self._done) > self._max:
                self._done.popitem(last=False)
            return response
        finally:
            del self._inflight[key]
