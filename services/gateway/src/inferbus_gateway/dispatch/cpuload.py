"""Whether CPU is what limits the gateway (for request bundling).

Two readings, taken every `interval_s` on the event loop and averaged:

* the machine's CPUs: the busy share of ``/proc/stat`` (all CPUs together),
  or of the cgroup's CPU quota where one is set (cgroup v2 ``cpu.max``,
  ``cpu.stat``), whichever is higher;
* the gateway's own event-loop thread: the share of the time it was not
  waiting for a CPU that it spent running (``/proc/thread-self/schedstat``).

Either one near 1 means requests wait for CPU anyway, so making some of them
wait a few milliseconds for fuller bundles (fewer messages, less CPU per
request) costs less than it gives (docs/architecture.md, "Bundles"). Where a
file cannot be read, that reading counts as not saturated.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

_PROC_STAT = Path("/proc/stat")
_SCHEDSTAT = Path("/proc/thread-self/schedstat")
_CGROUP_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_STAT = Path("/sys/fs/cgroup/cpu.stat")


def _machine() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs, or None where unreadable."""
    try:
        fields = _PROC_STAT.read_text().split("\n", 1)[0].split()
        values = [int(v) for v in fields[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    except (OSError, ValueError, IndexError):
        return None
    total = sum(values[:8])  # guest time is counted in user already
    return total - idle, total


def _cgroup_quota() -> float | None:
    """CPUs the cgroup may use (quota / period), or None without a quota."""
    try:
        quota, period = _CGROUP_MAX.read_text().split()
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _cgroup_usage_us() -> int | None:
    try:
        for line in _CGROUP_STAT.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _loop_thread() -> tuple[int, int] | None:
    """(ran, waited) nanoseconds of the calling thread, or None where unreadable."""
    try:
        run, wait, _ = _SCHEDSTAT.read_text().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


class CpuLoad:
    """Moving averages of the machine's and the loop thread's busy shares, with hysteresis.

    Args:
        interval_s: how often the readings are taken.
        alpha: weight of the newest interval in the averages.
        high: busy share at or above which CPU counts as what limits.
        low: busy share at or below which it stops counting so.
    """

    def __init__(
        self,
        *,
        interval_s: float = 0.1,
        alpha: float = 0.3,
        high: float = 0.9,
        low: float = 0.8,
    ) -> None:
        self._interval = interval_s
        self._alpha = alpha
        self._high = high
        self._low = low
        self.machine = 0.0
        """Busy share of the machine's CPUs (or of the cgroup's quota), 0..1."""
        self.loop = 0.0
        """Running share of the loop thread's time not spent waiting for a CPU, 0..1."""
        self.saturated = False
        self._handle: asyncio.TimerHandle | None = None
        self._quota = _cgroup_quota()
        self._last_wall = 0
        self._last_machine: tuple[int, int] | None = None
        self._last_cgroup: int | None = None
        self._last_thread: tuple[int, int] | None = None

    def start(self) -> None:
        """Start taking readings (call on the event loop's thread)."""
        if self._handle is not None:
            return
        self._read()
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._tick)

    def stop(self) -> None:
        """Stop taking readings."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _read(
        self,
    ) -> tuple[
        int,
        tuple[tuple[int, int] | None, tuple[int, int] | None],
        tuple[int | None, int | None],
        tuple[tuple[int, int] | None, tuple[int, int] | None],
    ]:
        """Wall time since the last read and (now, then) pairs of the three counters."""
        now = time.monotonic_ns()
        machine, cgroup, thread = _machine(), None, _loop_thread()
        if self._quota is not None:
            cgroup = _cgroup_usage_us()
        self._last_wall, last = now, (self._last_wall, self._last_machine, self._last_cgroup)
        previous = (last, self._last_thread)
        self._last_machine, self._last_cgroup, self._last_thread = machine, cgroup, thread
        (wall0, machine0, cgroup0), thread0 = previous
        return now - wall0, (machine, machine0), (cgroup, cgroup0), (thread, thread0)

    def _tick(self) -> None:
        wall, (machine, machine0), (cgroup, cgroup0), (thread, thread0) = self._read()
        a = self._alpha
        busy = 0.0
        if machine is not None and machine0 is not None and machine[1] > machine0[1]:
            busy = (machine[0] - machine0[0]) / (machine[1] - machine0[1])
        if cgroup is not None and cgroup0 is not None and self._quota and wall > 0:
            busy = max(busy, (cgroup - cgroup0) * 1000 / (wall * self._quota))
        self.machine += a * (min(1.0, max(0.0, busy)) - self.machine)
        if thread is not None and thread0 is not None:
            ran, waited = thread[0] - thread0[0], thread[1] - thread0[1]
            available = wall - waited  # running or sleeping
            if available > 0:
                self.loop += a * (min(1.0, max(0.0, ran / available)) - self.loop)
        level = max(self.machine, self.loop)
        self.saturated = level > self._low if self.saturated else level >= self._high
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._tick)
