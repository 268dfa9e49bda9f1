"""How saturated the gateway's event-loop thread is (for request bundling).

Every `interval_s` the loop thread reads its own scheduler statistics
(``/proc/thread-self/schedstat``: nanoseconds on a CPU and waiting for one)
and keeps a moving average of the share of wall time it was running or
runnable: its *demand*. Near 1 the loop always has work (or is starved of a
CPU): requests queue before it, and making them wait a little for a fuller
bundle costs no throughput. The dispatcher bundles aggressively only then
(docs/architecture.md, "Bundles"). Where schedstat is missing, the thread's
CPU time alone stands in (it misses time spent waiting for a CPU).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _read_schedstat() -> int | None:
    """Nanoseconds this thread ran plus waited to run, or None where unreadable."""
    try:
        run, wait, _ = _SCHEDSTAT.read_text().split()
        return int(run) + int(wait)
    except (OSError, ValueError):
        return None


class LoopLoad:
    """A moving average of the event-loop thread's demand, with hysteresis.

    Args:
        interval_s: how often the thread reads its statistics.
        alpha: weight of the newest interval in the average.
        high: demand at or above which the loop counts as saturated.
        low: demand at or below which it stops counting as saturated.
    """

    def __init__(
        self,
        *,
        interval_s: float = 0.05,
        alpha: float = 0.2,
        high: float = 0.9,
        low: float = 0.75,
    ) -> None:
        self._interval = interval_s
        self._alpha = alpha
        self._high = high
        self._low = low
        self.demand = 0.0
        """Moving average of the running-or-runnable share of wall time (0..1)."""
        self.saturated = False
        self._handle: asyncio.TimerHandle | None = None
        self._last_wall = 0
        self._last_busy = 0
        self._schedstat = True

    def _busy_ns(self) -> int:
        if self._schedstat:
            value = _read_schedstat()
            if value is not None:
                return value
            self._schedstat = False
        return time.thread_time_ns()

    def start(self) -> None:
        """Start sampling (call on the event loop's thread)."""
        if self._handle is not None:
            return
        self._last_wall = time.monotonic_ns()
        self._last_busy = self._busy_ns()
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._tick)

    def stop(self) -> None:
        """Stop sampling."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.monotonic_ns()
        busy = self._busy_ns()
        wall = now - self._last_wall
        if wall > 0:
            share = min(1.0, max(0.0, (busy - self._last_busy) / wall))
            self.demand += self._alpha * (share - self.demand)
            if self.saturated:
                self.saturated = self.demand > self._low
            else:
                self.saturated = self.demand >= self._high
        self._last_wall, self._last_busy = now, busy
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._tick)
