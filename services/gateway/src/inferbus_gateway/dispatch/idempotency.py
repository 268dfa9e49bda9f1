"""Retries of the same request are not computed twice.

A client that retries a request with the same id (after a timeout or a lost
connection) gets the first attempt's answer: joined while it is in flight,
replayed from a short-lived cache once answered. Only successful answers are
kept; errors are recomputed (most are cheap and retrying is the point). Per
gateway instance.

What a retry must match, and what it costs (docs/architecture.md,
"Idempotent retries"):

* **The key** is what identifies the request without reading its bytes:
  tenant, model, version (as the client named it), id, requested outputs,
  classification, and the sequence id and flags (so each step of a sequence is
  its own request). Looking it up is O(1) whatever the request's size; the
  tenant keeps one caller's id from ever reaching another caller's answer.
* **The inputs** are compared byte for byte, not hashed, and only when the key
  is already there (a retry, or an id reused): the first attempt's input
  tensors are kept by reference, which costs nothing on the event loop (they
  are the request's own immutable buffers; shared-memory inputs were copied
  when read). A reused id with different inputs never matches, so it is
  computed as a new request, exactly as with a full hash, and without one
  on every request.
* **The answer** is kept as a copy of its output bytes when they are views
  into a reply bundle (the bundle would otherwise stay alive with every other
  request's answer in it); the copy is bounded by `max_entry_bytes`.
* **Memory** is bounded in bytes (inputs + outputs kept + a fixed overhead per
  entry, `max_bytes`) and in entries; the oldest answers go first, and expired
  ones are dropped as new ones arrive. An answer larger than
  `max_entry_bytes` is not kept for replay (a concurrent retry still joins it).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from prometheus_client import Counter

from inferbus_common.codec import Buffer, Tensor
from inferbus_common.sequences import encode_sequence_id
from inferbus_gateway.canonical import InferRequest, InferResponse

REPLAYED = Counter(
    "inferbus_gateway_idempotent_replays_total",
    "Requests answered from an earlier attempt with the same id and inputs.",
    ["kind"],
)

ENTRY_OVERHEAD = 512
"""Bytes counted per kept answer beyond its tensors (key, objects, dict slot)."""

Key = tuple[str, str, str, str, tuple[str, ...], tuple[tuple[str, int], ...], str]
"""tenant, model, version, id, outputs, classification, sequence step."""

Inputs = tuple[Tensor, ...]
"""The first attempt's input tensors (the request's own objects, not copies)."""


def request_key(request: InferRequest) -> Key:
    """What identifies a request besides its input bytes (O(1): no byte is read)."""
    seq = request.sequence
    step = f"{encode_sequence_id(seq.id)}|{seq.flags}" if seq is not None else ""
    return (
        request.tenant,
        request.model,
        request.version,
        request.id,
        tuple(request.outputs),
        tuple(sorted(request.classification.items())) if request.classification else (),
        step,
    )


def inputs_of(request: InferRequest) -> Inputs:
    """The request's inputs as kept for comparison (references, no copy)."""
    return tuple(request.inputs)


def same_inputs(kept: Inputs, request: InferRequest) -> bool:
    """Whether `request` carries exactly the inputs `kept` (names, types, shapes, bytes)."""
    if len(kept) != len(request.inputs):
        return False
    for k, t in zip(kept, request.inputs, strict=True):
        if k.name != t.name or k.datatype != t.datatype or k.shape != t.shape:
            return False
        a, b = _raw(k.data), _raw(t.data)
        if a.nbytes != b.nbytes or a != b:
            return False
    return True


def _raw(data: Buffer) -> memoryview:
    """The bytes of a buffer, compared as bytes (a float view would call NaN != NaN)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(memoryview(t.data).nbytes for t in tensors)


def detached(response: InferResponse) -> InferResponse:
    """`response` with outputs that are views (into a reply bundle) copied to own bytes."""
    if not any(isinstance(t.data, memoryview) for t in response.outputs):
        return response
    outputs = [
        Tensor(t.name, t.datatype, t.shape, bytes(t.data)) if isinstance(t.data, memoryview) else t
        for t in response.outputs
    ]
    return InferResponse(
        response.model,
        response.version,
        response.id,
        outputs,
        response.timings_ms,
        response.digest,
        response.degraded,
        response.shm_outputs,
    )


@dataclass(slots=True)
class _Done:
    at: float
    inputs: Inputs
    response: InferResponse
    size: int


@dataclass(slots=True)
class _Pending:
    inputs: Inputs
    fut: asyncio.Future[InferResponse]


def _own_copy(response: InferResponse) -> InferResponse:
    """A copy whose lists and maps the caller may change: the steps after this one
    replace outputs in place (classification) and set shared-memory outputs, which
    must not reach the kept answer or another attempt's copy of it."""
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
        max_entries: bound on kept answers (oldest dropped first).
        max_bytes: bound on the bytes kept answers hold (inputs, outputs and
            `ENTRY_OVERHEAD` each; oldest dropped first).
        max_entry_bytes: an answer holding more is not kept for replay.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(
        self,
        window_s: float = 30.0,
        max_entries: int = 10_000,
        max_bytes: int = 64 << 20,
        max_entry_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window_s
        self._max = max_entries
        self._max_bytes = max_bytes
        self._max_entry_bytes = max_entry_bytes
        self._clock = clock
        self._inflight: dict[Key, _Pending] = {}
        self._done: OrderedDict[Key, _Done] = OrderedDict()
        self._bytes = 0

    @property
    def kept(self) -> tuple[int, int]:
        """Answers kept for replay and the bytes counted for them."""
        return len(self._done), self._bytes

    async def run(
        self, request: InferRequest, compute: Callable[[], Awaitable[InferResponse]]
    ) -> InferResponse:
        """Answer `request` with `compute()` unless an identical attempt exists."""
        if not request.id or self._window <= 0:
            return await compute()
        key = request_key(request)
        now = self._clock()
        self._expire(now)
        cached = self._done.get(key)
        if cached is not None and same_inputs(cached.inputs, request):
            REPLAYED.labels("cached").inc()
            return _own_copy(cached.response)
        pending = self._inflight.get(key)
        if pending is not None:
            if not same_inputs(pending.inputs, request):
                return await compute()  # an id reused for other inputs: a new request
            REPLAYED.labels("joined").inc()
            try:
                return _own_copy(await asyncio.shield(pending.fut))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if pending.fut.cancelled() and task is not None and not task.cancelling():
                    # The first attempt's client went away; this one still wants an answer.
                    return await compute()
                raise
        fut: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()
        inputs = inputs_of(request)
        self._inflight[key] = _Pending(inputs, fut)
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
            fut.set_result(response)
            self._keep(key, inputs, response)
            return response
        finally:
            del self._inflight[key]

    def _keep(self, key: Key, inputs: Inputs, response: InferResponse) -> None:
        size = ENTRY_OVERHEAD + _nbytes(inputs) + _nbytes(response.outputs)
        old = self._done.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        if size > self._max_entry_bytes:
            return
        self._done[key] = _Done(self._clock(), inputs, _own_copy(detached(response)), size)
        self._bytes += size
        while self._done and (len(self._done) > self._max or self._bytes > self._max_bytes):
            _, dropped = self._done.popitem(last=False)
            self._bytes -= dropped.size

    def _expire(self, now: float) -> None:
        """Drop answers older than the window (oldest first: amortised O(1))."""
        while self._done:
            oldest = next(iter(self._done.values()))
            if now - oldest.at <= self._window:
                return
            self._done.popitem(last=False)
            self._bytes -= oldest.size
