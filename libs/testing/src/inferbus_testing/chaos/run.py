"""One fault under load: `run_fault` and its `FaultReport`."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from inferbus_testing.chaos.faults import Fault
from inferbus_testing.chaos.load import Attempt, ClosedLoad
from inferbus_testing.chaos.stack import ChaosStack


@dataclass(frozen=True)
class Shape:
    """How long and how hard one fault run is."""

    concurrency: int = 6
    deadline_s: float = 2.0
    grace_s: float = 1.0
    before_s: float = 1.0
    stable_s: float = 1.0
    after_max_s: float = 15.0

    @classmethod
    def ci(cls) -> Shape:
        """The short variant for the default test run."""
        return cls()

    @classmethod
    def long(cls) -> Shape:
        """The report's variant: more clients, longer before and after."""
        return cls(concurrency=8, before_s=3.0, stable_s=3.0, after_max_s=30.0)


@dataclass
class FaultReport:
    """What happened to the requests sent while one fault came and went."""

    fault: str
    what: str
    load: str
    sent: int
    correct: int
    explicit_errors: dict[str, int]
    wrong: int
    hung: int
    baseline_rps: float
    first_ok_s: float | None
    recovered_s: float | None
    duration_s: float
    retried: int
    in_flight: int = 0
    """Requests in flight when the fault struck (sent, not answered)."""
    in_flight_answered_s: float | None = None
    """When the last of those was answered, seconds after the fault struck."""
    alive: dict[str, bool] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    first_ok_after_fault_s: float | None = None
    """From the fault being in place (e.g. the kill done) to the first correct
    answer to a request sent after it, before any heal."""

    @property
    def explicit(self) -> int:
        """Requests answered with an explicit error before their deadline."""
        return sum(self.explicit_errors.values())

    @property
    def lost(self) -> int:
        """Requests with neither a correct answer, nor an explicit error, nor counted hung."""
        return self.sent - self.correct - self.explicit - self.hung

    def row(self) -> dict[str, Any]:
        """A flat dict for JSON and the markdown table."""
        return {
            "fault": self.fault,
            "what": self.what,
            "load": self.load,
            "sent": self.sent,
            "correct": self.correct,
            "explicit_error": self.explicit,
            "errors": dict(self.explicit_errors),
            "lost": self.lost,
            "wrong": self.wrong,
            "hung": self.hung,
            "first_ok_s": self.first_ok_s,
            "first_ok_after_fault_s": self.first_ok_after_fault_s,
            "recovered_s": self.recovered_s,
            "baseline_rps": round(self.baseline_rps, 1),
            "retried": self.retried,
            "in_flight": self.in_flight,
            "in_flight_answered_s": self.in_flight_answered_s,
            "duration_s": round(self.duration_s, 2),
            "alive": self.alive,
        }


EXPLICIT = frozenset({"DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"})
"""Statuses a fault may legitimately produce: not computed in time, or not
reachable. Anything else (INTERNAL, UNKNOWN, INVALID_ARGUMENT, ...) is a bug."""


def assert_nothing_lost(report: FaultReport) -> None:
    """Print the report; fail unless every request got exactly one answer, a
    correct one or an explicit error (`EXPLICIT`) before its deadline."""
    print(report.row(), *report.samples, sep="\n  ")
    assert report.sent > 50, report.row()
    assert report.wrong == 0, report.samples
    assert report.hung == 0, report.samples
    assert report.lost == 0, report.row()
    assert set(report.explicit_errors) <= EXPLICIT, report.samples


def _all_ok_since(attempts: list[Attempt], since: float, until: float) -> bool:
    window = [a for a in attempts if a.start >= since and a.end <= until]
    return bool(window) and all(a.status == "OK" for a in window)


async def run_fault(
    stack: ChaosStack, fault: Fault, shape: Shape, *, through_edge: bool = False
) -> FaultReport:
    """Run `fault` under closed-loop load and measure what the clients saw.

    The clients call the gateways (each client starting at its own, failing over
    to the next), or with `through_edge` the stack's edge only.

    Recovery: after `heal`, the load goes on until every request of the last
    `stable_s` seconds was answered correctly (or `after_max_s` passes).
    ``first_ok_s`` is the time from the heal to the first correct answer;
    ``recovered_s`` the time from the heal to the start of the run of correct
    answers that lasts to the end (0 when nothing failed after the heal).
    """
    load = ClosedLoad(
        [stack.edge_url] if through_edge else stack.grpc_urls,
        stack.model_dir,
        concurrency=shape.concurrency,
        deadline_s=shape.deadline_s,
        grace_s=shape.grace_s,
    )
    t_begin = time.monotonic()
    async with load:
        await asyncio.sleep(shape.before_s)
        t_fault = time.monotonic()
        before = [a for a in load.attempts if a.end <= t_fault]
        await fault.inject(stack)
        t_broken = time.monotonic()  # the fault is in place (a kill has returned)
        await asyncio.sleep(fault.hold_s)
        await fault.heal(stack)
        t_heal = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if now - t_heal >= shape.stable_s and _all_ok_since(
                load.attempts, now - shape.stable_s, now
            ):
                break
            if now - t_heal >= shape.after_max_s:
                break
    t_end = time.monotonic()
    attempts = load.attempts
    counts = collections.Counter(a.status for a in attempts)
    errors = {k: v for k, v in counts.items() if k not in ("OK", "WRONG", "HANG")}
    first_ok = [a.end for a in attempts if a.status == "OK" and a.end >= t_heal]
    first_ok_after_fault = [a.end for a in attempts if a.status == "OK" and a.start >= t_broken]
    bad_after = [a.start for a in attempts if a.status != "OK" and a.end >= t_fault]
    recovered: float | None
    if not _all_ok_since(attempts, t_end - shape.stable_s, t_end):
        recovered = None
    elif not bad_after or max(bad_after) < t_heal:
        recovered = 0.0
    else:
        recovered = max(bad_after) - t_heal
    samples = sorted({f"{a.status}: {a.message[:160]}" for a in attempts if a.message})
    caught = [a for a in attempts if a.start < t_broken < a.end]
    return FaultReport(
        fault=fault.name,
        what=fault.what,
        load=(
            f"closed loop, {shape.concurrency} clients "
            + (
                f"through the edge ({len(stack.gateways)} gateways behind it)"
                if through_edge
                else f"over {len(stack.gateways)} gateways"
            )
            + f", deadline {shape.deadline_s:g} s"
        ),
        sent=len(attempts),
        correct=counts["OK"],
        explicit_errors=errors,
        wrong=counts["WRONG"],
        hung=counts["HANG"],
        baseline_rps=len(before) / max(1e-9, t_fault - t_begin),
        first_ok_s=round(min(first_ok) - t_heal, 3) if first_ok else None,
        recovered_s=round(recovered, 3) if recovered is not None else None,
        duration_s=t_end - t_begin,
        retried=sum(1 for a in attempts if a.tries > 1),
        in_flight=len(caught),
        in_flight_answered_s=(round(max(a.end for a in caught) - t_broken, 3) if caught else None),
        alive=stack.alive(),
        samples=samples[:12],
        first_ok_after_fault_s=(
            round(min(first_ok_after_fault) - t_broken, 3) if first_ok_after_fault else None
        ),
    )
