"""Circuit breaker per model: stop sending requests to a model that keeps failing.

States:

* **closed** — requests pass; outcomes are counted over a sliding window
  (`window_s`, in `buckets` slices). When the window holds at least
  `min_requests` outcomes and the share of failures (errors and timeouts)
  reaches `failure_rate`, the breaker opens.
* **open** — requests are refused at once (`BreakerOpen`, an `Unavailable`, or a fallback answer
  if the model has one) for `open_s` seconds.
* **half-open** — after the cool-down, `half_open_probes` requests are let
  through as probes; when all of them succeed the breaker closes (with a fresh
  window), the first failed probe opens it again for another `open_s`.

Purely in-process, on an injectable monotonic clock, so tests never sleep.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge

from inferbus_common.errors import (
    DeadlineExceeded,
    InferbusError,
    Internal,
    Unavailable,
)
from inferbus_gateway.dispatch.noworker import NoLiveWorker

log = logging.getLogger(__name__)

STATE = Gauge(
    "inferbus_gateway_breaker_state",
    "Circuit breaker state per model: 0 closed, 1 half-open, 2 open.",
    ["model"],
)


class BreakerOpen(Unavailable):
    """UNAVAILABLE because a model's circuit breaker refuses requests right now.

    Args:
        message: client-facing text.
        model: the model whose breaker is open.
        retry_after_s: seconds until the breaker lets probes through.
    """

    def __init__(self, message: str, *, model: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.model = model
        self.retry_after_s = retry_after_s


class BreakerState(enum.IntEnum):
    """A breaker's state; the value is what the gauge shows."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


def counts_as_failure(exc: BaseException | None) -> bool | None:
    """How an outcome counts for the breaker.

    Returns:
        False for a success, True for a failure of the model's serving path
        (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, or any non-inferbus error), and
        None for outcomes that say nothing about the model's health (bad requests,
        limits, auth, cancellation, the breaker's own refusals), which are not counted.
    """
    if exc is None:
        return False
    if isinstance(exc, BreakerOpen | asyncio.CancelledError):
        return None  # our own refusal says nothing new about the model
    if isinstance(exc, NoLiveWorker):
        # Known cause, answered at once: an open breaker would only hide it (and
        # hold the model's traffic back for its cool-down once a worker is back).
        return None
    if isinstance(exc, Unavailable | DeadlineExceeded | Internal):
        return True
    if isinstance(exc, InferbusError):
        return None
    return True


class CircuitBreaker:
    """One model's breaker.

    Args:
        model: the model it guards (for messages and the gauge).
        window_s: length of the sliding window of outcomes.
        buckets: slices of the window (outcomes age out one slice at a time).
        min_requests: outcomes needed in the window before it may open.
        failure_rate: share of failures (0..1] that opens it.
        open_s: cool-down before probing.
        half_open_probes: probes let through in half-open; all must succeed.
        clock: monotonic clock in seconds.
    """

    def __init__(
        self,
        model: str,
        *,
        window_s: float = 10.0,
        buckets: int = 10,
        min_requests: int = 20,
        failure_rate: float = 0.5,
        open_s: float = 5.0,
        half_open_probes: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < failure_rate <= 1:
            raise ValueError("failure_rate must be in (0, 1]")
        if window_s <= 0 or buckets < 1 or min_requests < 1 or half_open_probes < 1:
            raise ValueError("window_s, buckets, min_requests and half_open_probes must be > 0")
        self.model = model
        self._slice_s = window_s / buckets
        self._min_requests = min_requests
        self._failure_rate = failure_rate
        self._open_s = open_s
        self._probes = half_open_probes
        self._clock = clock
        # Ring of [slice index, total, failures, timeouts].
        self._ring: list[list[int]] = [[-1, 0, 0, 0] for _ in range(buckets)]
        self.state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probes_out = 0
        self._probes_ok = 0
        STATE.labels(model).set(0)

    # --- window ----------------------------------------------------------------------
    def _slot(self, now: float) -> list[int]:
        idx = math.floor(now / self._slice_s)
        slot = self._ring[idx % len(self._ring)]
        if slot[0] != idx:
            slot[:] = [idx, 0, 0, 0]
        return slot

    def window(self) -> tuple[int, int, int]:
        """(requests, failures, timeouts) in the current window."""
        current = math.floor(self._clock() / self._slice_s)
        oldest = current - len(self._ring) + 1
        total = failures = timeouts = 0
        for idx, n, f, t in self._ring:
            if oldest <= idx <= current:
                total, failures, timeouts = total + n, failures + f, timeouts + t
        return total, failures, timeouts

    def _set(self, state: BreakerState, why: str) -> None:
        if state is self.state:
            return
        log.warning(
            "circuit breaker of model '%s': %s -> %s (%s)",
            self.model,
            self.state.name.lower(),
            state.name.lower(),
            why,
            extra={"model": self.model},
        )
        self.state = state
        STATE.labels(self.model).set(int(state))

    # --- decisions -------------------------------------------------------------------
    def allow(self) -> None:
        """Let a request through, or raise.

        Every request allowed must be followed by exactly one `record_*` call.

        Raises:
            BreakerOpen: the breaker is open (or half-open with all probes out).
        """
        now = self._clock()
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self._open_s:
                remaining = self._open_s - (now - self._opened_at)
                raise BreakerOpen(
                    f"model '{self.model}' is failing; its circuit breaker is open for "
                    f"another {remaining:.1f}s",
                    model=self.model,
                    retry_after_s=remaining,
                )
            self._set(BreakerState.HALF_OPEN, "cool-down over, probing")
            self._probes_out = self._probes_ok = 0
        if self.state is BreakerState.HALF_OPEN:
            if self._probes_out >= self._probes:
                raise BreakerOpen(
                    f"model '{self.model}' is recovering; its circuit breaker lets only "
                    f"{self._probes} probe requests through",
                    model=self.model,
                    retry_after_s=0.1,
                )
            self._probes_out += 1

    def record_success(self) -> None:
        """The request allowed last got a good answer."""
        self._record(False, False)

    def record_failure(self, *, timeout: bool = False) -> None:
        """The request failed (`timeout`: by its deadline)."""
        self._record(True, timeout)

    def record(self, exc: BaseException | None) -> None:
        """Record an outcome by its exception (None = success), per `counts_as_failure`.

        Outcomes that say nothing about the model's health free a half-open
        probe slot without counting.
        """
        failed = counts_as_failure(exc)
        if failed is None:
            if self.state is BreakerState.HALF_OPEN and self._probes_out > 0:
                self._probes_out -= 1
            return
        self._record(failed, isinstance(exc, DeadlineExceeded))

    def _record(self, failed: bool, timeout: bool) -> None:
        now = self._clock()
        if self.state is BreakerState.HALF_OPEN:
            if failed:
                self._open(now, "a probe failed")
                return
            self._probes_ok += 1
            if self._probes_ok >= self._probes:
                for slot in self._ring:
                    slot[:] = [-1, 0, 0, 0]
                self._set(BreakerState.CLOSED, f"{self._probes_ok} probes succeeded")
            return
        if self.state is BreakerState.OPEN:
            return  # a straggler sent before it opened
        slot = self._slot(now)
        slot[1] += 1
        if failed:
            slot[2] += 1
        if timeout:
            slot[3] += 1
        if failed:
            total, failures, timeouts = self.window()
            if total >= self._min_requests and failures >= self._failure_rate * total:
                self._open(now, f"{failures}/{total} failed ({timeouts} timeouts)")

    def _open(self, now: float, why: str) -> None:
        self._opened_at = now
        self._set(BreakerState.OPEN, why)


class BreakerBoard:
    """One `CircuitBreaker` per model, created on first use with shared settings.

    Args:
        **options: keyword arguments of `CircuitBreaker` (except ``model``).
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._breakers: dict[str, CircuitBreaker] = {}

    def get(self, model: str) -> CircuitBreaker:
        """The breaker of `model`."""
        breaker = self._breakers.get(model)
        if breaker is None:
            breaker = CircuitBreaker(model, **self._options)
            self._breakers[model] = breaker
        return breaker
