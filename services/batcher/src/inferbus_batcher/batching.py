"""Batch formation for one model version: pure logic, no I/O, no clock reads.

A `ModelQueue` holds the requests waiting for one (model, version). Requests
whose tensors share a `wire.batch_signature` (names, datatypes, non-batch
dims) form a *group*; only requests of one group ever share a batch. Inside a
group every priority level has its own FIFO, and batches take from level 1
(the highest) first.

The dispatch rules follow Triton's dynamic batcher (`inferbus_common.batchrule`,
the rule the worker's merge uses too):

* a batch goes as soon as its rows reach ``max_batch_size`` (or the next
  request would not fit: a request's rows are never split);
* with ``preferred_batch_sizes``, the largest preferred size that the waiting
  requests add up to is sent at once; when no preferred size can form and the
  next request would overshoot the largest one, what is pending goes;
* otherwise the group waits until its oldest request has waited
  ``max_queue_delay_us``, then sends what it has (up to ``max_batch_size``);
* ``max_batch_size == 0`` means no batching: every request is its own batch.

Deadlines are unix-epoch ns (they cross processes); waiting times use the
monotonic clock. The caller passes both "now"s in, so the logic is testable
without sleeping and the hot path reads each clock once per event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from inferbus_common.batchrule import BatchRule
from inferbus_common.codec import Tensor
from inferbus_common.errors import InvalidArgument, ResourceExhausted
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.microbatch import BatchEntry

_NEVER = 1 << 63


@dataclass(slots=True, eq=False)
class PendingRequest:
    """A request accepted into a queue, waiting for a batch.

    Attributes:
        envelope: the request's metadata (id, deadline as sent, priority asked
            for, outputs, trace context), as the gateway built it.
        reply: the gateway inbox its reply bundle goes to.
        token: the request's token in that gateway's reply bundles.
        deadline_ns: absolute deadline, unix ns (the model's default timeout
            when the envelope has none).
        enqueued_ns: when it was accepted, unix ns (carried to the worker).
        enqueued_mono_ns: when it was accepted, monotonic ns (for waiting times).
        rows: rows along the batch axis.
        priority: level, 1 = highest.
        signature: `tensors.batch_signature` of its tensors.
        tensors: its input tensors (zero-copy views of the message body).
        mirror: inbox a copy of the reply also goes to (shadow compare; '' = none).
        mirror_token: the mirror copy's token.
        since_mono_ns: monotonic time from which its batching delay counts:
            when the gateway took it (the time spent in the gateway's bundle
            counts against the delay).
    """

    envelope: Envelope
    reply: str
    token: int
    deadline_ns: int
    enqueued_ns: int
    enqueued_mono_ns: int
    rows: int
    priority: int
    signature: tuple
    tensors: list[Tensor] = field(repr=False)
    mirror: str = ""
    mirror_token: int = 0
    span: Any = field(default=None, repr=False, compare=False)
    """The request's trace span while it waits (only when sampled)."""
    since_mono_ns: int = -1

    def __post_init__(self) -> None:
        if self.since_mono_ns < 0:
            self.since_mono_ns = self.enqueued_mono_ns

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.envelope.request_id

    def entry(self) -> BatchEntry:
        """This request's entry in a micro-batch header."""
        env = self.envelope
        return BatchEntry(
            env.request_id,
            self.reply,
            self.deadline_ns,
            self.enqueued_ns,
            self.rows,
            env.outputs,
            env.traceparent,
            self.mirror,
            self.token,
            self.mirror_token,
        )


@dataclass(slots=True)
class FormedBatch:
    """Requests chosen to run together, in row order.

    Attributes:
        requests: the requests; request i owns the rows after those of 0..i-1.
        rows: total rows.
    """

    requests: list[PendingRequest]
    rows: int


@dataclass(slots=True)
class Dispatch:
    """What one call to `ModelQueue.take_ready` produced.

    Attributes:
        batches: batches to publish now, in the order they formed.
        expired: requests whose deadline passed while they waited (to be
            answered DEADLINE_EXCEEDED; never put in a batch).
        limited: True when more batches were ready than the caller's limit
            allowed; call again once there is room.
    """

    batches: list[FormedBatch] = field(default_factory=list)
    expired: list[PendingRequest] = field(default_factory=list)
    limited: bool = False


class _Group:
    """Requests of one batch signature, one FIFO per priority level."""

    __slots__ = ("count", "levels", "rows")

    def __init__(self, levels: int) -> None:
        self.levels: list[deque[PendingRequest]] = [deque() for _ in range(levels)]
        self.rows = 0
        self.count = 0

    def __iter__(self) -> Iterator[PendingRequest]:
        for level in self.levels:
            yield from level

    def oldest_mono_ns(self) -> int:
        """Monotonic enqueue time of the request that has waited longest."""
        return min((lv[0].since_mono_ns for lv in self.levels if lv), default=_NEVER)

    def pop_prefix(self, n: int) -> list[PendingRequest]:
        """Remove and return the first `n` requests in priority order."""
        out: list[PendingRequest] = []
        for level in self.levels:
            while level and len(out) < n:
                out.append(level.popleft())
            if len(out) == n:
                break
        self.count -= len(out)
        self.rows -= sum(p.rows for p in out)
        return out


class ModelQueue:
    """Waiting requests of one model version and the policy that batches them.

    Args:
        model: model name.
        version: model version.
        config: the version's `config.json`; `configure` swaps it live.
    """

    def __init__(self, model: str, version: str, config: ModelConfig) -> None:
        self.model = model
        self.version = version
        self._groups: dict[tuple, _Group] = {}
        self._counts: list[int] = []
        self._earliest_deadline_ns = _NEVER
        self.wake_mono_ns: int | None = None
        """Monotonic time at which `take_ready` should run next (None: nothing waits)."""
        self.configure(config)

    # --- configuration -------------------------------------------------------
    def configure(self, config: ModelConfig) -> None:
        """Apply a (possibly changed) model config; queued requests stay queued."""
        b = config.batching
        self.config = config
        self.max_batch_size = config.max_batch_size
        self.delay_ns = b.max_queue_delay_us * 1000
        self.max_queue_size = b.max_queue_size
        self.default_timeout_ns = b.default_timeout_ms * 1_000_000
        self.default_priority = b.default_priority
        self.priority_levels = b.priority_levels
        self.rule = BatchRule.of(config)
        self.min_preferred = self.rule.min_preferred
        # Levels only grow while requests wait in them; a config with fewer
        # levels simply stops assigning the higher numbers.
        grow = b.priority_levels - len(self._counts)
        if grow > 0:
            self._counts.extend([0] * grow)
            for g in self._groups.values():
                g.levels.extend(deque() for _ in range(grow))

    def priority_of(self, requested: int) -> int:
        """Level for a request's ``Ib-Priority`` (0 or out of range → the default)."""
        if 1 <= requested <= self.priority_levels:
            return requested
        return self.default_priority

    # --- state ---------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Requests waiting, all levels and groups together."""
        return sum(self._counts)

    # --- intake --------------------------------------------------------------
    def offer(self, request: PendingRequest) -> None:
        """Queue a request.

        Raises:
            InvalidArgument: its rows exceed ``max_batch_size`` (rows are never split).
            ResourceExhausted: its priority level already holds ``max_queue_size``
                requests (reason ``queue-full``).
        """
        if self.max_batch_size > 0 and request.rows > self.max_batch_size:
            raise InvalidArgument(
                f"{self.model}:{self.version}: request has {request.rows} rows, "
                f"more than max_batch_size {self.max_batch_size}"
            )
        level = request.priority - 1
        if self._counts[level] >= self.max_queue_size:
            raise ResourceExhausted(
                f"queue of model '{self.model}' version '{self.version}' is full: "
                f"{self.max_queue_size} requests wait at priority {request.priority} "
                f"(max_queue_size {self.max_queue_size})",
                reason="queue-full",
            )
        group = self._groups.get(request.signature)
        if group is None:
            group = self._groups[request.signature] = _Group(len(self._counts))
        group.levels[level].append(request)
        group.rows += request.rows
        group.count += 1
        self._counts[level] += 1
        if request.deadline_ns < self._earliest_deadline_ns:
            self._earliest_deadline_ns = request.deadline_ns

    # --- dispatch ------------------------------------------------------------
    def take_ready(
        self,
        now_mono_ns: int,
        now_wall_ns: int,
        *,
        limit: int | None = None,
        flush: bool = False,
    ) -> Dispatch:
        """Remove expired requests and the batches that are due, and re-arm the wake time.

        Args:
            now_mono_ns: monotonic now (waiting times).
            now_wall_ns: unix-epoch now (deadlines).
            limit: most batches to return (the caller's publishing room).
            flush: send everything that waits, ignoring delays (shutdown).
        """
        out = Dispatch()
        if now_wall_ns >= self._earliest_deadline_ns:
            self._expire(now_wall_ns, out.expired)
        room = _NEVER if limit is None else limit
        for sig in list(self._groups):
            group = self._groups[sig]
            while group.count:
                if len(out.batches) >= room:
                    out.limited = True
                    break
                n = self._ready_count(group, now_mono_ns, flush)
                if n == 0:
                    break
                requests = group.pop_prefix(n)
                for p in requests:
                    self._counts[p.priority - 1] -= 1
                out.batches.append(FormedBatch(requests, sum(p.rows for p in requests)))
            if not group.count:
                del self._groups[sig]
        self._rearm(now_mono_ns, now_wall_ns)
        return out

    def _ready_count(self, group: _Group, now_mono_ns: int, flush: bool) -> int:
        """How many requests (a prefix in priority order) to send now; 0 = wait."""
        if self.max_batch_size == 0:
            return 1
        delay_exceeded = (
            flush or self.delay_ns == 0 or now_mono_ns - group.oldest_mono_ns() >= self.delay_ns
        )
        # Fast path for the common case: nothing can fill yet and time is left.
        if not delay_exceeded and group.rows < self.min_preferred:
            return 0
        return self.rule.cut((p.rows for p in group), waited=delay_exceeded)

    def _expire(self, now_wall_ns: int, into: list[PendingRequest]) -> None:
        earliest = _NEVER
        for sig in list(self._groups):
            group = self._groups[sig]
            for i, level in enumerate(group.levels):
                if not level:
                    continue
                keep: deque[PendingRequest] = deque()
                for p in level:
                    if p.deadline_ns <= now_wall_ns:
                        into.append(p)
                        group.count -= 1
                        group.rows -= p.rows
                        self._counts[i] -= 1
                    else:
                        keep.append(p)
                        if p.deadline_ns < earliest:
                            earliest = p.deadline_ns
                group.levels[i] = keep
            if not group.count:
                del self._groups[sig]
        self._earliest_deadline_ns = earliest

    def _rearm(self, now_mono_ns: int, now_wall_ns: int) -> None:
        if not self._groups:
            self.wake_mono_ns = None
            self._earliest_deadline_ns = _NEVER
            return
        wake = min(g.oldest_mono_ns() for g in self._groups.values()) + self.delay_ns
        if self._earliest_deadline_ns != _NEVER:
            # Deadlines are wall-clock; translate to the monotonic clock.
            wake = min(wake, now_mono_ns + (self._earliest_deadline_ns - now_wall_ns))
        self.wake_mono_ns = wake

    def drain_all(self) -> list[PendingRequest]:
        """Remove and return every waiting request (for a last answer on shutdown)."""
        out: list[PendingRequest] = []
        for group in self._groups.values():
            out.extend(group)
        self._groups.clear()
        self._counts = [0] * len(self._counts)
        self._earliest_deadline_ns = _NEVER
        self.wake_mono_ns = None
        return out
