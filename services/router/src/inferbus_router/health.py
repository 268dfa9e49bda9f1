"""Health-aware canary weights, from the gateway's audit records.

Every router instance subscribes to all audit records (``<prefix>.audit.>``,
one JSON `AuditRecord` per answered request) and keeps, per model version, a
sliding window of outcomes and latencies. Each evaluation compares a route's
canary with its stable version; when the canary is far worse (error rate above
stable's by more than a margin, or p99 latency above a multiple of stable's)
and both have enough samples, the canary's *factor* is cut (down to a floor);
when it is healthy again the factor climbs back step by step to 1.

The router multiplies the route's configured canary weight by this factor. It
never writes the route: the rollout controller (or an operator) owns the
configured weight; this only scales what is sent while a canary misbehaves.
All instances see the same records, so they converge on the same factor.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Gauge
from pydantic import ValidationError

from inferbus_common.audit import decode_record, split_records
from inferbus_common.catalog import Route

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

NOT_THE_VERSIONS_FAULT = frozenset(
    {"OK", "NOT_FOUND", "UNAUTHENTICATED", "PERMISSION_DENIED", "CANCELLED"}
)
"""Statuses that do not count against a version; every other one does.
INVALID_ARGUMENT counts: the gateway validated the request against the
model's config before routing it, so an engine that still rejects the inputs
is the version's fault (and the judgement is relative to stable, which sees
the same clients)."""


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a canary counts as unhealthy, and how its weight moves.

    Attributes:
        window_s: sliding window of records per version.
        min_samples: fewer records than this (on either side) → no judgement.
        max_error_rate_gap: unhealthy when canary error rate exceeds stable's by more.
        max_p99_ratio: unhealthy when canary p99 exceeds stable p99 times this ...
        p99_slack_ms: ... plus this (so sub-millisecond noise never trips it).
        floor: lowest factor; the canary keeps some traffic to show recovery.
        decrease: factor multiplier per unhealthy evaluation.
        recover_step: factor added per healthy evaluation, up to 1.
        max_samples: bound on records kept per version.
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


@dataclass(slots=True)
class VersionWindow:
    """Recent outcomes of one model version."""

    samples: deque[tuple[float, bool, float]] = field(default_factory=deque)
    """(monotonic arrival time, is_error, latency_ms), oldest first."""

    def add(self, t: float, error: bool, latency_ms: float, max_samples: int) -> None:
        """Record one outcome, dropping the oldest beyond `max_samples`."""
        self.samples.append((t, error, latency_ms))
        if len(self.samples) > max_samples:
            self.samples.popleft()

    def prune(self, cutoff: float) -> None:
        """Forget outcomes older than `cutoff` (monotonic seconds)."""
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()

    def stats(self) -> tuple[int, float, float]:
        """(count, error rate, p99 latency in ms of all outcomes) of the window."""
        n = len(self.samples)
        if n == 0:
            return 0, 0.0, 0.0
        errors = sum(1 for _, e, _ in self.samples if e)
        lat = sorted(x for _, _, x in self.samples)
        return n, errors / n, lat[min(n - 1, int(0.99 * n))]


class HealthWeights:
    """Sliding-window health per version and the canary factor it implies.

    Args:
        policy: thresholds and steps.
        clock: monotonic time source (tests pass their own).
    """

    def __init__(self, policy: HealthPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._windows: dict[tuple[str, str], VersionWindow] = {}
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
            error = rec.status not in NOT_THE_VERSIONS_FAULT
            self.record(rec.model, rec.version, error, rec.latency_ms)

    def record(self, model: str, version: str, error: bool, latency_ms: float) -> None:
        """Record one outcome of (`model`, `version`)."""
        window = self._windows.get((model, version))
        if window is None:
            window = self._windows[(model, version)] = VersionWindow()
        window.add(self._clock(), error, latency_ms, self.policy.max_samples)

    def factor(self, model: str, version: str) -> float:
        """Current factor (floor..1) of a canary's configured weight."""
        return self._factors.get((model, version), 1.0)

    def effective_weight(self, route: Route) -> float:
        """The canary percent the router uses for `route` right now."""
        if not route.canary:
            return 0.0
        return route.canary_weight * self.factor(route.model, route.canary)

    def stats(self, model: str, version: str) -> tuple[int, float, float]:
        """(count, error rate, p99 ms) of a version's current window."""
        window = self._windows.get((model, version))
        if window is None:
            return 0, 0.0, 0.0
        window.prune(self._clock() - self.policy.window_s)
        return window.stats()

    def unhealthy_reason(self, model: str, canary: str, stable: str) -> str | None:
        """Why the canary is far worse than stable, None when it is not (or unknown)."""
        p = self.policy
        nc, err_c, p99_c = self.stats(model, canary)
        ns, err_s, p99_s = self.stats(model, stable)
        if nc < p.min_samples or ns < p.min_samples:
            return None
        if err_c - err_s > p.max_error_rate_gap:
            return f"error rate {err_c:.1%} vs stable {err_s:.1%}"
        if p99_c > p99_s * p.max_p99_ratio + p.p99_slack_ms:
            return f"p99 {p99_c:.1f} ms vs stable {p99_s:.1f} ms"
        return None

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
            reason = self.unhealthy_reason(route.model, route.canary, route.stable)
            if reason is not None:
                new = max(p.floor, old * p.decrease)
            else:
                new = min(1.0, old + p.recover_step)
            if new != old:
                log.warning(
                    "canary weight factor %s → %s",
                    f"{old:.2f}",
                    f"{new:.2f}",
                    extra={
                        "model": route.model,
                        "version": route.canary,
                        "reason": reason or "recovered",
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
