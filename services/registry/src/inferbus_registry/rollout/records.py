"""Rollout records (the ``<prefix>_rollouts`` bucket's JSON), the step verdict and
plan checks: pure, no I/O. See docs/architecture.md ("Rollout state machine").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_common.versionhealth import Thresholds, WindowStats, errors_worse, latency_worse

RolloutStateName = Literal["running", "paused", "succeeded", "rolled_back", "aborted"]
ACTIVE: frozenset[str] = frozenset({"running", "paused"})


class StepStats(BaseModel):
    """What one version did during a step's window (kept in the rollout record)."""

    requests: int = 0
    """Requests it answered or failed (outcomes that are not its doing excluded)."""
    errors: int = 0
    p99_ms: float = 0.0
    """p99 latency of its successful requests (0 = none)."""

    @classmethod
    def of(cls, stats: WindowStats) -> StepStats:
        """The summary of a window."""
        return cls(requests=stats.requests, errors=stats.errors, p99_ms=round(stats.p99_ms, 3))


class StepRecord(BaseModel):
    """The audit of one step: weight, window, verdict."""

    step: int
    weight: float
    started_unix_ms: int
    ended_unix_ms: int = 0
    outcome: str = "running"
    """running | passed | failed | paused | aborted | rolled_back."""
    reason: str = ""
    canary: StepStats = Field(default_factory=StepStats)
    stable: StepStats = Field(default_factory=StepStats)


class Rollout(BaseModel):
    """One progressive rollout of one model (the rollouts bucket's record)."""

    id: str
    model: str
    version: str
    """The canary being rolled out."""
    previous_stable: str
    """Stable when the rollout started (restored by a rollback after success)."""
    steps: list[float]
    interval_s: float
    max_error_rate: float = 0.01
    max_p99_ratio: float = 1.5
    """0 turns the latency check off."""
    p99_slack_ms: float = 5.0
    """Absolute slack on the latency check, so a 1 ms vs 2 ms p99 is not a failure."""
    min_requests: int = 20
    on_fail: Literal["rollback", "pause"] = "rollback"
    state: RolloutStateName = "running"
    step: int = 0
    """Index into `steps` of the current step."""
    step_started_unix_ms: int = 0
    reason: str = ""
    """Why it is in its state (failure, operator action, success)."""
    started_by: str = ""
    created_unix_ms: int = 0
    updated_unix_ms: int = 0
    stable_p99_ms: float = 0.0
    """Baseline: stable's p99 from the last window where it served enough requests."""
    restored_stable: str = ""
    """Set by a rollback after success: the stable version to move back to."""
    ready_timeout_s: float = 120.0
    """How long the canary may take to be loaded before the rollout fails."""
    ready_unix_ms: int = 0
    """When a worker first reported the canary ready (0: still warming up: the
    route names it as canary at weight 0 so workers load it, and no step runs)."""
    applied: bool = False
    """An ended rollout whose effect on the route and aliases is done; a registry
    that restarts re-applies only ended rollouts without it (never overriding
    what operators changed later)."""
    history: list[StepRecord] = Field(default_factory=list)

    @property
    def weight(self) -> float:
        """Canary weight of the current step."""
        return self.steps[min(self.step, len(self.steps) - 1)]

    @property
    def active(self) -> bool:
        """Running or paused."""
        return self.state in ACTIVE


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict of one evaluation."""

    action: Literal["wait", "advance", "fail"]
    reason: str


def thresholds(rollout: Rollout) -> Thresholds:
    """The rollout's thresholds in the comparison shared with the router."""
    return Thresholds(
        min_samples=max(1, rollout.min_requests),
        error_margin=rollout.max_error_rate,
        max_p99_ratio=rollout.max_p99_ratio,
        p99_slack_ms=rollout.p99_slack_ms,
    )


def evaluate(
    rollout: Rollout, canary: WindowStats, stable: WindowStats, now_unix_ms: int
) -> Decision:
    """Continue, wait or fail the current step of `rollout`.

    The comparison is `inferbus_common.versionhealth`'s (the router's too): a
    verdict needs `min_requests` canary requests and a confidence test.

    * Failing fast: a canary error rate above ``max_error_rate`` (plus stable's
      own, when stable has enough requests: a canary is not blamed for what
      both versions suffer) with confidence fails the step at once.
    * At the end of the interval, with `min_requests` canary requests: a p99
      above ``max_p99_ratio`` × stable's p99 (+ ``p99_slack_ms``) with
      confidence fails; otherwise the step passes. Stable's p99 comes from this
      window or, when stable served too little (e.g. at 100 %), the last baseline.
    * Without enough canary requests the step waits: a rollout never
      advances without evidence.
    """
    t = thresholds(rollout)
    where = f"at step {rollout.step + 1} ({rollout.weight:g}%)"
    errors = errors_worse(canary, stable, t)
    if errors.worse:
        return Decision("fail", f"canary {errors.reason} {where}")
    elapsed_s = (now_unix_ms - rollout.step_started_unix_ms) / 1000.0
    if elapsed_s < rollout.interval_s:
        return Decision("wait", f"step window open ({elapsed_s:.1f}/{rollout.interval_s:g}s)")
    need = t.min_samples
    if canary.requests < need:
        return Decision(
            "wait", f"waiting for {need} canary requests (have {canary.requests}) to judge"
        )
    baseline = stable.p99_ms if stable.requests >= need else rollout.stable_p99_ms
    latency = latency_worse(canary, baseline, t)
    if latency.worse:
        return Decision("fail", f"canary {latency.reason} {where}")
    return Decision(
        "advance",
        f"healthy: {canary.requests} requests, error rate {canary.error_rate:.3f}, "
        f"p99 {canary.p99_ms:.1f} ms (stable {baseline:.1f} ms)",
    )


def check_plan(
    steps: list[float],
    interval_s: float,
    max_error_rate: float,
    max_p99_ratio: float,
    min_requests: int,
    on_fail: str,
) -> None:
    """Refuse a rollout plan that cannot work.

    Raises:
        InvalidArgument: with what to fix.
    """
    if not steps:
        raise InvalidArgument("a rollout needs steps, e.g. --steps 5,25,50,100")
    if any(not 0 < w <= 100 for w in steps):
        raise InvalidArgument(f"steps {steps}: every weight must be within (0, 100]")
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise InvalidArgument(f"steps {steps} must be strictly ascending")
    if steps[-1] != 100:
        raise InvalidArgument(f"steps {steps} must end at 100 (the canary then becomes stable)")
    if not interval_s > 0:
        raise InvalidArgument("the step interval must be positive (e.g. --interval 60s)")
    if not 0 <= max_error_rate <= 1:
        raise InvalidArgument("--max-error-rate must be within 0-1")
    if max_p99_ratio != 0 and max_p99_ratio < 1:
        raise InvalidArgument("--max-p99-ratio must be 0 (off) or at least 1")
    if min_requests < 1:
        raise InvalidArgument("--min-requests must be at least 1")
    if on_fail not in ("rollback", "pause"):
        raise InvalidArgument("--on-fail must be 'rollback' or 'pause'")


def transition(current: Rollout, action: str, reason: str, now: int) -> Rollout:
    """The record after an operator's `action` (pause, resume, abort, rollback).

    Raises:
        FailedPrecondition: the action does not apply to the current state.
    """
    state = current.state
    if action == "pause":
        if state != "running":
            raise FailedPrecondition(f"rollout {current.id} is {state}, not running")
        return close_step(current, "paused", reason, now, state="paused")
    if action == "resume":
        if state != "paused":
            raise FailedPrecondition(f"rollout {current.id} is {state}, not paused")
        # A fresh window: what happened while paused is not this step's evidence.
        return current.model_copy(
            update={
                "state": "running",
                "reason": reason,
                "step_started_unix_ms": now,
                "history": [
                    *current.history,
                    StepRecord(step=current.step + 1, weight=current.weight, started_unix_ms=now),
                ],
            }
        )
    if action == "abort":
        if state not in ACTIVE:
            raise FailedPrecondition(f"rollout {current.id} already ended ({state})")
        return close_step(current, "aborted", reason, now, state="aborted")
    # rollback
    if state in ACTIVE:
        return close_step(current, "rolled_back", reason, now, state="rolled_back")
    if state == "succeeded":
        return current.model_copy(
            update={
                "state": "rolled_back",
                "reason": reason,
                "restored_stable": current.previous_stable,
            }
        )
    raise FailedPrecondition(f"rollout {current.id} already ended ({state}); nothing to roll back")


def close_step(
    current: Rollout,
    outcome: str,
    reason: str,
    now: int,
    *,
    state: str,
    canary: WindowStats | None = None,
    stable: WindowStats | None = None,
) -> Rollout:
    """`current` in `state`, its running step closed with `outcome` and the windows."""
    history = list(current.history)
    if history and history[-1].outcome == "running":
        last = history[-1].model_copy(
            update={
                "ended_unix_ms": now,
                "outcome": outcome,
                "reason": reason,
                **({"canary": StepStats.of(canary)} if canary is not None else {}),
                **({"stable": StepStats.of(stable)} if stable is not None else {}),
            }
        )
        history[-1] = last
    return current.model_copy(update={"state": state, "reason": reason, "history": history})
