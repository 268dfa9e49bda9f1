"""How a canary is judged against stable: one rule for the router's health-scaled
weights and the registry's rollout analysis.

Outcome classes of audit statuses, windows of outcomes, the percentile, and a
comparison that needs evidence before it calls a canary worse: a minimum
sample count and a one-sided binomial test at `ALPHA` against the margin
(error rate) or the latency threshold (tail share). The latencies of a fresh
window's first outcomes are warm-up and not counted (their errors are). See
docs/architecture.md ("Health-aware weights", "Rollout state machine").
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

ALPHA = 0.01
"""Largest chance that a canary as good as the margin is called worse by one comparison."""
TAIL_SHARE = 0.01
"""Share of requests allowed over the latency threshold (the threshold is a p99 bound)."""


class Outcome(enum.Enum):
    """What an answered request says about the version that served it."""

    SUCCESS = "success"
    FAULT = "fault"
    """The version's fault: every status but the ones below."""
    NEUTRAL = "neutral"
    """Not the version's doing: not counted."""


NOT_THE_VERSIONS_FAULT = frozenset(
    {"NOT_FOUND", "UNAUTHENTICATED", "PERMISSION_DENIED", "CANCELLED"}
)
"""Statuses that say nothing about the version: an unknown model or alias, a caller
refused by admission, a client that gave up. INVALID_ARGUMENT and
FAILED_PRECONDITION count as faults: the gateway validated the request against
the model's config before routing it, so an engine that still rejects it, or a
version its workers refuse to load, is the version's fault (and the judgement
is relative to stable, which sees the same clients)."""


def classify(status: str) -> Outcome:
    """The outcome class of an audit record's status."""
    if status == "OK":
        return Outcome.SUCCESS
    if status in NOT_THE_VERSIONS_FAULT:
        return Outcome.NEUTRAL
    return Outcome.FAULT


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (`q` in 0-100) of `values`; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one version did over a window."""

    requests: int = 0
    """Outcomes counted (successes and faults)."""
    errors: int = 0
    latencies_ms: tuple[float, ...] = ()
    """Latencies of the successful requests (warm-up ones excluded), ascending."""

    @property
    def error_rate(self) -> float:
        """errors / requests (0 without requests)."""
        return self.errors / self.requests if self.requests else 0.0

    @property
    def p99_ms(self) -> float:
        """p99 latency of the successful requests (0 = none)."""
        return percentile(list(self.latencies_ms), 99.0)

    def over(self, threshold_ms: float) -> int:
        """Successful requests slower than `threshold_ms`."""
        lat = self.latencies_ms
        lo, hi = 0, len(lat)
        while lo < hi:
            mid = (lo + hi) // 2
            if lat[mid] <= threshold_ms:
                lo = mid + 1
            else:
                hi = mid
        return len(lat) - lo


class OutcomeWindow:
    """Outcomes of one version: (timestamp, fault?, latency ms or None), oldest first.

    The latencies of the first `warmup` outcomes are not kept (None): a freshly
    loaded version's first requests (lazy initialisation, cold caches) are not
    its steady speed. Their success or fault still counts, so a failing
    version is judged as soon as without a warm-up.

    Args:
        max_samples: bound on the outcomes kept (the oldest go first).
        warmup: outcomes at the start whose latency is not counted.
    """

    __slots__ = ("_skip", "samples")

    def __init__(self, *, max_samples: int = 200_000, warmup: int = 0) -> None:
        self.samples: deque[tuple[float, bool, float | None]] = deque(maxlen=max_samples)
        self._skip = warmup

    def add(self, ts: float, status: str, latency_ms: float) -> bool:
        """Record one outcome by its audit status; False when it is not counted (neutral)."""
        outcome = classify(status)
        if outcome is Outcome.NEUTRAL:
            return False
        latency: float | None = latency_ms
        if self._skip > 0:
            self._skip -= 1
            latency = None
        self.samples.append((ts, outcome is Outcome.FAULT, latency))
        return True

    def prune(self, before: float) -> None:
        """Forget outcomes stamped before `before`."""
        while self.samples and self.samples[0][0] < before:
            self.samples.popleft()

    def stats(self, since: float = float("-inf")) -> WindowStats:
        """What the version did from `since` on."""
        requests = errors = 0
        latencies: list[float] = []
        for ts, fault, latency in self.samples:
            if ts < since:
                continue
            requests += 1
            if fault:
                errors += 1
            elif latency is not None:
                latencies.append(latency)
        latencies.sort()
        return WindowStats(requests, errors, tuple(latencies))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_pmf = (
        math.lgamma(n + 1)
        - math.lgamma(k + 1)
        - math.lgamma(n - k + 1)
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )
    term = math.exp(log_pmf)
    total = term
    ratio = p / (1.0 - p)
    for i in range(k, n):
        term *= (n - i) / (i + 1) * ratio
        total += term
        if term < total * 1e-15:
            break
    return min(1.0, total)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a canary counts as worse than stable.

    Attributes:
        min_samples: fewer counted outcomes than this on the canary → no verdict.
        error_margin: a canary error rate up to stable's (when stable has
            `min_samples`) plus this is acceptable.
        max_p99_ratio: latency threshold = stable's p99 × this + `p99_slack_ms`
            (0 turns the latency check off).
        p99_slack_ms: absolute slack on the threshold (sub-millisecond noise).
        alpha: the test's level (`ALPHA`).
    """

    min_samples: int
    error_margin: float
    max_p99_ratio: float
    p99_slack_ms: float
    alpha: float = ALPHA


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of `compare`."""

    worse: bool
    """The canary is worse with confidence (the reason says how)."""
    judged: bool
    """Enough samples to say anything (False: `worse` is False for lack of evidence)."""
    reason: str


def errors_worse(canary: WindowStats, stable: WindowStats, t: Thresholds) -> Verdict:
    """Is the canary's error rate above stable's (when known) plus the margin, with confidence?"""
    if canary.requests < t.min_samples:
        return Verdict(False, False, f"{canary.requests} of {t.min_samples} canary samples")
    allowed = t.error_margin + (stable.error_rate if stable.requests >= t.min_samples else 0.0)
    if canary.error_rate <= allowed:
        return Verdict(False, True, "error rate within the margin")
    p = binomial_tail(canary.errors, canary.requests, min(1.0, allowed))
    if p >= t.alpha:
        return Verdict(
            False, True, f"error rate {canary.error_rate:.1%} over {allowed:.1%}, not significant"
        )
    return Verdict(
        True,
        True,
        f"error rate {canary.error_rate:.1%} ({canary.errors}/{canary.requests}) > allowed "
        f"{allowed:.1%} (p={p:.1g})",
    )


def latency_worse(canary: WindowStats, stable_p99_ms: float, t: Thresholds) -> Verdict:
    """Are more than `TAIL_SHARE` of the canary's successes slower than stable's p99 ×
    ratio + slack, with confidence? (A p99 over the threshold, tested.)"""
    n = len(canary.latencies_ms)
    enough = canary.requests >= t.min_samples and n > 0
    if t.max_p99_ratio <= 0 or stable_p99_ms <= 0:
        return Verdict(False, enough, "no latency baseline")
    if not enough:
        return Verdict(False, False, f"{canary.requests} of {t.min_samples} canary samples")
    threshold = stable_p99_ms * t.max_p99_ratio + t.p99_slack_ms
    slow = canary.over(threshold)
    if slow <= TAIL_SHARE * n:
        return Verdict(False, True, "p99 within the threshold")
    p = binomial_tail(slow, n, TAIL_SHARE)
    if p >= t.alpha:
        return Verdict(False, True, f"{slow}/{n} over {threshold:.1f} ms, not significant")
    return Verdict(
        True,
        True,
        f"p99 {canary.p99_ms:.1f} ms vs stable {stable_p99_ms:.1f} ms: {slow}/{n} requests over "
        f"{t.max_p99_ratio:g} x + {t.p99_slack_ms:g} ms = {threshold:.1f} ms (p={p:.1g})",
    )


def compare(
    canary: WindowStats, stable: WindowStats, t: Thresholds, *, stable_p99_ms: float | None = None
) -> Verdict:
    """The canary against stable: errors first, then latency.

    Args:
        canary: the canary's window.
        stable: stable's window.
        t: thresholds.
        stable_p99_ms: the latency baseline; None = stable's p99 when stable has
            `min_samples`, else no latency judgement.
    """
    err = errors_worse(canary, stable, t)
    if err.worse:
        return err
    if stable_p99_ms is None:
        stable_p99_ms = stable.p99_ms if stable.requests >= t.min_samples else 0.0
    lat = latency_worse(canary, stable_p99_ms, t)
    if lat.worse:
        return lat
    return Verdict(False, err.judged, err.reason if not err.judged else "healthy")
