"""Health-aware canary weights: a factor on each canary's configured weight, cut
while the audit records show it worse than stable with confidence
(`inferbus_common.versionhealth`, the rule rollouts use too), climbing back to
1 otherwise. It never writes the route. See docs/architecture.md
("Health-aware weights").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Gauge
from pydantic import ValidationError

from inferbus_common.audit import decode_record, split_records
from inferbus_common.catalog import Route
from inferbus_common.versionhealth import (
    ALPHA,
    OutcomeWindow,
    Thresholds,
    Verdict,
    WindowStats,
    compare,
)

log = logging.getLogger(__name__)

EFFECTIVE_WEIGHT = Gauge(
    "inferbus_router_effective_weight",
    "Percent of unpinned traffic each version gets after health scaling.",
    ["model", "version"],
)
HEALTH_FACTOR = Gauge(
    "inferbus_router_canary_health_factor",
    "Factor (floor..1) the router applies to a canary's configured weight.",
    ["model", "version"],
)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a canary counts as unhealthy, and how its weight moves.

    Attributes:
        window_s: sliding window of records per version.
        min_samples: fewer counted canary records than this → no judgement.
        max_error_rate_gap: unhealthy when canary error rate exceeds stable's by more
            (with confidence, `versionhealth.errors_worse`).
        max_p99_ratio: unhealthy when canary p99 exceeds stable p99 times this ...
        p99_slack_ms: ... plus this (with confidence, `versionhealth.latency_worse`).
        floor: lowest factor; the canary keeps some traffic to show recovery.
        decrease: factor multiplier per unhealthy evaluation.
        recover_step: factor added per evaluation that does not find it unhealthy.
        max_samples: bound on records kept per version.
        warmup_samples: first records of a version (per router) whose latency is not
            counted.
        alpha: level of the confidence test.
    """

    window_s: float = 30.0
    min_samples: int = 30
    max_error_rate_gap: float = 0.05
    max_p99_ratio: float = 2.0
    p99_slack_ms: float = 5.0
    floor: float = 0.1
    decrease: float = 0.5
    recover_step: float = 0.1
    max_samples: int = 20_000
    warmup_samples: int = 10
    alpha: float = ALPHA

    def thresholds(self) -> Thresholds:
        """The comparison's thresholds."""
        return Thresholds(
            min_samples=self.min_samples,
            error_margin=self.max_error_rate_gap,
            max_p99_ratio=self.max_p99_ratio,
            p99_slack_ms=self.p99_slack_ms,
            alpha=self.alpha,
        )


class HealthWeights:
    """Sliding-window health per version and the canary factor it implies.

    Args:
        policy: thresholds and steps.
        clock: monotonic time source (tests pass their own).
    """

    def __init__(self, policy: HealthPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._thresholds = policy.thresholds()
        self._clock = clock
        self._windows: dict[tuple[str, str], OutcomeWindow] = {}
        self._factors: dict[tuple[str, str], float] = {}
        self._published: dict[tuple[str, str], float] = {}
        self._factors_exported: set[tuple[str, str]] = set()

    def observe(self, data: bytes) -> None:
        """Take one audit message (one or more JSON records, one per line); malformed
        records are ignored, the others of the message still count."""
        for line in split_records(data):
            try:
                rec = decode_record(line)
            except (ValidationError, ValueError):
                continue
            if not rec.version:
                continue
            self.record_status(rec.model, rec.version, rec.status, rec.latency_ms)

    def record_status(self, model: str, version: str, status: str, latency_ms: float) -> None:
        """Record one answered request of (`model`, `version`) by its audit status."""
        window = self._windows.get((model, version))
        if window is None:
            p = self.policy
            window = OutcomeWindow(max_samples=p.max_samples, warmup=p.warmup_samples)
            self._windows[(model, version)] = window
        window.add(self._clock(), status, latency_ms)

    def record(self, model: str, version: str, error: bool, latency_ms: float) -> None:
        """Record one outcome of (`model`, `version`): a fault or a success."""
        self.record_status(model, version, "INTERNAL" if error else "OK", latency_ms)

    def factor(self, model: str, version: str) -> float:
        """Current factor (floor..1) of a canary's configured weight."""
        return self._factors.get((model, version), 1.0)

    def effective_weight(self, route: Route) -> float:
        """The canary percent the router uses for `route` right now."""
        if not route.canary:
            return 0.0
        return route.canary_weight * self.factor(route.model, route.canary)

    def window_stats(self, model: str, version: str) -> WindowStats:
        """A version's current window."""
        window = self._windows.get((model, version))
        if window is None:
            return WindowStats()
        window.prune(self._clock() - self.policy.window_s)
        return window.stats()

    def stats(self, model: str, version: str) -> tuple[int, float, float]:
        """(count, error rate, p99 ms of successes) of a version's current window."""
        w = self.window_stats(model, version)
        return w.requests, w.error_rate, w.p99_ms

    def verdict(self, model: str, canary: str, stable: str) -> Verdict:
        """The canary against stable over the current windows."""
        return compare(
            self.window_stats(model, canary), self.window_stats(model, stable), self._thresholds
        )

    def unhealthy_reason(self, model: str, canary: str, stable: str) -> str | None:
        """Why the canary is worse than stable with confidence, None when it is not (or
        there is too little evidence to say)."""
        v = self.verdict(model, canary, stable)
        return v.reason if v.worse else None

    def evaluate(self, routes: dict[str, Route]) -> None:
        """Move each canary's factor one step, forget windows of gone versions,
        and export the effective weights."""
        p = self.policy
        live: set[tuple[str, str]] = set()
        canaries: set[tuple[str, str]] = set()
        for route in list(routes.values()):
            live.add((route.model, route.stable))
            if not route.canary or route.canary == route.stable:
                self._set_weights(route, None)
                continue
            key = (route.model, route.canary)
            live.add(key)
            canaries.add(key)
            old = self._factors.get(key, 1.0)
            verdict = self.verdict(route.model, route.canary, route.stable)
            if verdict.worse:
                new = max(p.floor, old * p.decrease)
            else:
                # Judged healthy, or too little traffic to judge: a cut canary climbs
                # back towards its configured weight (cuts need evidence, recovery not).
                new = min(1.0, old + p.recover_step)
            new = 1.0 if new > 1.0 - 1e-9 else round(new, 6)
            if new != old:
                log.log(
                    logging.WARNING if verdict.worse else logging.INFO,
                    "canary weight factor %s → %s",
                    f"{old:.2f}",
                    f"{new:.2f}",
                    extra={
                        "model": route.model,
                        "version": route.canary,
                        "reason": verdict.reason if verdict.worse else "recovered",
                        "configured_weight": route.canary_weight,
                        "effective_weight": round(route.canary_weight * new, 3),
                    },
                )
            if new >= 1.0:
                self._factors.pop(key, None)
            else:
                self._factors[key] = new
            self._set_weights(route, route.canary)
        for key in [k for k in self._windows if k not in live]:
            del self._windows[key]
        # A factor belongs to a version while it is a canary: promoted to
        # stable or dropped, it starts afresh next time.
        for key in [k for k in self._factors if k not in canaries]:
            del self._factors[key]
        for key in [k for k in self._factors_exported if k not in canaries]:
            self._factors_exported.discard(key)
            HEALTH_FACTOR.remove(*key)
        for key in [k for k in self._published if k not in live]:
            del self._published[key]
            EFFECTIVE_WEIGHT.remove(*key)

    def _set_weights(self, route: Route, canary: str | None) -> None:
        weight = self.effective_weight(route) if canary else 0.0
        self._publish((route.model, route.stable), 100.0 - weight)
        if canary:
            self._publish((route.model, canary), weight)
            HEALTH_FACTOR.labels(route.model, canary).set(self.factor(route.model, canary))
            self._factors_exported.add((route.model, canary))

    def _publish(self, key: tuple[str, str], value: float) -> None:
        if self._published.get(key) != value:
            self._published[key] = value
            EFFECTIVE_WEIGHT.labels(*key).set(value)
