"""The canary rule shared by the router and the rollouts: classes, windows, the test."""

from __future__ import annotations

import math

from inferbus_common.versionhealth import (
    Outcome,
    OutcomeWindow,
    Thresholds,
    WindowStats,
    binomial_tail,
    classify,
    compare,
    percentile,
)

T = Thresholds(min_samples=30, error_margin=0.05, max_p99_ratio=2.0, p99_slack_ms=5.0)


def _brute_tail(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def test_binomial_tail_matches_the_sum() -> None:
    for k, n, p in [(1, 30, 0.01), (3, 30, 0.01), (10, 40, 0.05), (0, 5, 0.5), (6, 5, 0.5)]:
        assert math.isclose(binomial_tail(k, n, p), _brute_tail(k, n, p), rel_tol=1e-9)
    assert binomial_tail(1, 10, 0.0) == 0.0


def test_statuses_are_classified_once() -> None:
    assert classify("OK") is Outcome.SUCCESS
    for status in ("INTERNAL", "UNAVAILABLE", "INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        assert classify(status) is Outcome.FAULT
    for status in ("NOT_FOUND", "CANCELLED", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        assert classify(status) is Outcome.NEUTRAL
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_window_skips_warm_up_latencies_and_neutral_outcomes() -> None:
    w = OutcomeWindow(warmup=2)
    for ts, status, ms in [(1, "OK", 900), (2, "INTERNAL", 1), (3, "OK", 5), (4, "CANCELLED", 1)]:
        w.add(ts, status, ms)
    assert w.stats() == WindowStats(3, 1, (5.0,))
    assert w.stats(since=3) == WindowStats(1, 0, (5.0,))


def _window(n: int, errors: int = 0, ms: float = 10.0, slow: int = 0) -> WindowStats:
    ok = n - errors
    return WindowStats(n, errors, tuple(sorted([ms] * (ok - slow) + [ms * 10] * slow)))


def test_worse_needs_samples_and_significance() -> None:
    stable = _window(270)
    assert not compare(_window(29, errors=29), stable, T).judged  # too few samples
    assert compare(_window(30, errors=30), stable, T).worse
    assert not compare(_window(30, errors=3), stable, T).worse  # 10 % vs 5 %: p = 0.19
    assert compare(_window(300, errors=30), stable, T).worse  # the same rate, more evidence
    assert not compare(_window(30, slow=1), stable, T).worse  # one outlier
    assert compare(_window(30, slow=30), stable, T).worse
    verdict = compare(_window(30), stable, T)
    assert verdict.judged and not verdict.worse
