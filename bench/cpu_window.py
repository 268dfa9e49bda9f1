"""CPU time of server processes and bus messages over one measured window.

Linux only: CPU comes from ``/proc/<pid>/stat`` (utime + stime, all threads),
summed over each named process and its descendants, so a server that forks
(tritonserver and its Python stubs, MLServer's parallel workers) counts whole.
Bus messages come from nats-server's ``/varz`` (``in_msgs``: published to it,
``out_msgs``: delivered by it). `run_all.py` reads a `Snapshot` at the end of
the load generator's warm-up and one at the end of its run; `window_figures`
turns the two into CPU µs and messages per answered request. See
``docs/benchmarks.md`` for the figures.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of one ``/proc/<pid>/stat`` line that the benchmark uses."""

    pid: int
    comm: str
    ppid: int
    session: int
    cpu_ticks: int
    """utime + stime in clock ticks (``SC_CLK_TCK``), every thread of the process."""


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line.

    The command name sits in parentheses and may itself hold spaces and
    parentheses, so the fields are split after its last ``)``.

    Raises:
        ValueError: the text is not a stat line.
    """
    head, sep, tail = text.rpartition(")")
    pid_s, open_paren, comm = head.partition(" (")
    fields = tail.split()
    if not sep or not open_paren or len(fields) < 13:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    # Fields after the name, counted from 0: state, ppid, pgrp, session, ...,
    # utime (11), stime (12); proc(5) numbers them 3.. from the pid.
    return ProcStat(
        pid=int(pid_s),
        comm=comm,
        ppid=int(fields[1]),
        session=int(fields[3]),
        cpu_ticks=int(fields[11]) + int(fields[12]),
    )


def read_stat(pid: int) -> ProcStat | None:
    """`ProcStat` of a running process, or None when it is gone."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return None


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far.

    Raises:
        ProcessLookupError: the process is gone.
    """
    stat = read_stat(pid)
    if stat is None:
        raise ProcessLookupError(pid)
    return stat.cpu_ticks / os.sysconf("SC_CLK_TCK")


def all_stats() -> dict[int, ProcStat]:
    """Every process this machine shows in ``/proc``, by pid."""
    stats: dict[int, ProcStat] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name))
            if stat is not None:
                stats[stat.pid] = stat
    return stats


def process_tree(root: int, stats: Mapping[int, ProcStat]) -> list[int]:
    """`root` and its descendants, found by parent pid.

    When `root` leads its own session (started with ``start_new_session``),
    every process of that session counts too, so a child whose parent exited
    (reparented to init) is still found.

    Returns:
        The pids, `root` first, the rest ascending; empty when `root` is gone.
    """
    if root not in stats:
        return []
    children: dict[int, list[int]] = {}
    for s in stats.values():
        children.setdefault(s.ppid, []).append(s.pid)
    found = {root}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    if stats[root].session == root:
        found |= {s.pid for s in stats.values() if s.session == root}
    return [root, *sorted(found - {root})]


def nats_msgs(monitor_port: int) -> tuple[int, int] | None:
    """nats-server's ``in_msgs`` and ``out_msgs`` counters (None when unreadable)."""
    if not monitor_port:
        return None
    try:
        varz = httpx.get(f"http://127.0.0.1:{monitor_port}/varz", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    return int(varz["in_msgs"]), int(varz["out_msgs"])


@dataclass(frozen=True, slots=True)
class Snapshot:
    """CPU ticks of every process of some named groups, and the bus counters, at one time."""

    t: float
    """`time.monotonic` when it was read."""
    procs: dict[str, dict[int, tuple[str, int]]]
    """group name → pid → (command name, CPU ticks); an empty dict when the root is gone."""
    msgs: tuple[int, int] | None = None
    """nats-server (in_msgs, out_msgs), when there is a nats-server to ask."""
    hz: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"))


def take_snapshot(
    groups: Mapping[str, int],
    msgs: Callable[[], tuple[int, int] | None] | None = None,
) -> Snapshot:
    """Read every group's process tree now.

    Args:
        groups: name → root pid (``gateway`` → its pid, ``triton`` → the
            PyTriton script that starts tritonserver).
        msgs: reads the bus counters (e.g. ``lambda: nats_msgs(port)``).
    """
    stats = all_stats()
    t = time.monotonic()
    procs = {
        name: {pid: (stats[pid].comm, stats[pid].cpu_ticks) for pid in process_tree(root, stats)}
        for name, root in groups.items()
    }
    return Snapshot(t=t, procs=procs, msgs=msgs() if msgs is not None else None)


def per_request_us(cpu_s: float, rps: float, window_s: float) -> float | None:
    """CPU µs per answered request: CPU seconds ÷ (throughput × window)."""
    answered = rps * window_s
    return 1e6 * cpu_s / answered if answered > 0 else None


def window_figures(start: Snapshot, end: Snapshot, rps: float) -> dict[str, Any]:
    """CPU and bus messages per answered request between two snapshots.

    Args:
        start: read when the load generator's warm-up ended.
        end: read when its run ended.
        rps: the load generator's throughput over its measured window.

    Returns:
        ``window_s``; ``tick_s`` (the CPU clock's resolution, per process);
        ``cpu_us_per_req`` and ``busy_core`` by group and
        ``total_cpu_us_per_req``; ``processes`` (group, command name, pid,
        µs/req) of every process that used CPU; ``found`` (group → command
        name → how many processes at the end); ``msgs_in_per_req`` and
        ``msgs_out_per_req`` when both snapshots have bus counters; ``notes``
        for what could not be counted (a group whose root was not found, a
        process that exited in the window: its CPU since the start is lost).
    """
    wall = end.t - start.t
    out: dict[str, Any] = {
        "window_s": round(wall, 3),
        "tick_s": 1.0 / end.hz,
        "cpu_us_per_req": {},
        "busy_core": {},
    }
    processes: list[list[Any]] = []
    notes: list[str] = []
    total = 0.0
    for name, now in end.procs.items():
        before = start.procs.get(name, {})
        if not now or not before:
            notes.append(f"{name}: process not found at the {'end' if not now else 'start'}")
            continue
        group_s = 0.0
        for pid, (comm, ticks) in now.items():
            # A process born inside the window counts from zero.
            cpu_s = (ticks - before.get(pid, (comm, 0))[1]) / end.hz
            group_s += cpu_s
            us = per_request_us(cpu_s, rps, wall)
            if cpu_s > 0 and us is not None:
                processes.append([name, comm, pid, round(us, 1)])
        for pid, (comm, _) in before.items():
            if pid not in now:
                notes.append(f"{name}: {comm}[{pid}] exited in the window (its CPU is missing)")
        us = per_request_us(group_s, rps, wall)
        out["cpu_us_per_req"][name] = round(us, 1) if us is not None else None
        out["busy_core"][name] = round(group_s / wall, 3) if wall > 0 else None
        total += group_s
    total_us = per_request_us(total, rps, wall)
    out["total_cpu_us_per_req"] = round(total_us, 1) if total_us is not None else None
    out["processes"] = processes
    out["found"] = {
        name: dict(Counter(comm for comm, _ in procs.values())) for name, procs in end.procs.items()
    }
    if start.msgs is not None and end.msgs is not None and rps * wall > 0:
        answered = rps * wall
        out["msgs_in_per_req"] = round((end.msgs[0] - start.msgs[0]) / answered, 3)
        out["msgs_out_per_req"] = round((end.msgs[1] - start.msgs[1]) / answered, 3)
    out["notes"] = notes
    return out


def missing_processes(
    found: Mapping[str, Mapping[str, int]], expect: Mapping[str, Mapping[str, int]]
) -> list[str]:
    """Notes for every expected process that a window did not see.

    Args:
        found: `window_figures`' ``found``.
        expect: group → command name prefix → how many processes at least
            (``{"triton": {"tritonserver": 1}}``).
    """
    notes = []
    for group, wanted in expect.items():
        have = found.get(group, {})
        for prefix, least in wanted.items():
            n = sum(count for comm, count in have.items() if comm.startswith(prefix))
            if n < least:
                notes.append(
                    f"{group}: expected {least} {prefix!r} process(es) in its tree, found {n}"
                    f" (its CPU is not in the figure); tree: {dict(have) or 'none'}"
                )
    return notes


class WindowSampler:
    """Takes the start and end snapshots on the load generator's marks.

    `mark` is called (from the thread that reads the load generator's stderr)
    with ``measuring`` when its warm-up ends and ``measured`` when its last
    request is answered.

    Args:
        groups: name → root pid, as `take_snapshot` takes them.
        msgs: reads nats-server's counters, when there is one.
        expect: processes each group should have (see `missing_processes`).
    """

    def __init__(
        self,
        groups: Mapping[str, int],
        msgs: Callable[[], tuple[int, int] | None] | None = None,
        expect: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        self.groups = dict(groups)
        self.msgs = msgs
        self.expect = dict(expect or {})
        self.start: Snapshot | None = None
        self.end: Snapshot | None = None

    def mark(self, what: str) -> None:
        """Take the snapshot for a ``measuring`` or ``measured`` mark."""
        if what == "measuring":
            self.start = take_snapshot(self.groups, self.msgs)
        elif what == "measured" and self.start is not None:
            self.end = take_snapshot(self.groups, self.msgs)

    def figures(self, rps: float) -> dict[str, Any] | None:
        """`window_figures` of the two snapshots; None when a mark never came."""
        if self.start is None or self.end is None:
            return None
        figures = window_figures(self.start, self.end, rps)
        if self.msgs is not None and (self.start.msgs is None or self.end.msgs is None):
            figures["notes"].append("nats-server's /varz was unreadable: no bus message figures")
        return figures
