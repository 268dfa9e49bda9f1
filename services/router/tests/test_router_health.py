"""Health-aware canary weights: windows, thresholds, floor and recovery."""

from __future__ import annotations

from prometheus_client import REGISTRY

from inferbus_common.catalog import Route
from inferbus_router.health import HealthPolicy, HealthWeights
from inferbus_testing.records import audit_record

POLICY = HealthPolicy(
    window_s=10.0, min_samples=20, floor=0.1, decrease=0.5, recover_step=0.25, warmup_samples=0
)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _route(model: str) -> Route:
    return Route(model=model, stable="1", versions=["1", "2"], canary="2", canary_weight=20.0)


def _feed(hw: HealthWeights, model: str, version: str, n: int, *, errors: int = 0, ms: float = 5.0):
    for i in range(n):
        hw.record(model, version, i < errors, ms)


def _gauge(name: str, model: str, version: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": model, "version": version})


def test_error_prone_canary_is_cut_to_the_floor_and_recovers() -> None:
    clock = Clock()
    hw = HealthWeights(POLICY, clock)
    route = _route("hw-err")
    routes = {route.model: route}
    _feed(hw, "hw-err", "1", 100)
    _feed(hw, "hw-err", "2", 40, errors=10)  # 25 % errors vs 0 %
    factors = []
    for _ in range(6):
        hw.evaluate(routes)
        factors.append(hw.factor("hw-err", "2"))
    assert factors == [0.5, 0.25, 0.125, 0.1, 0.1, 0.1]
    assert hw.effective_weight(route) == 2.0
    assert _gauge("inferbus_router_effective_weight", "hw-err", "2") == 2.0
    assert _gauge("inferbus_router_effective_weight", "hw-err", "1") == 98.0
    # The window slides past the bad records; healthy ones replace them.
    clock.t += 11
    _feed(hw, "hw-err", "1", 100)
    _feed(hw, "hw-err", "2", 40)
    recovered = []
    for _ in range(5):
        hw.evaluate(routes)
        recovered.append(hw.factor("hw-err", "2"))
    assert recovered == [0.35, 0.6, 0.85, 1.0, 1.0]
    assert _gauge("inferbus_router_effective_weight", "hw-err", "2") == 20.0


def test_slow_canary_is_cut_but_noise_and_few_samples_are_not() -> None:
    clock = Clock()
    hw = HealthWeights(POLICY, clock)
    route = _route("hw-slow")
    routes = {route.model: route}
    _feed(hw, "hw-slow", "1", 100, ms=10.0)
    _feed(hw, "hw-slow", "2", 10, ms=500.0)  # too few samples to judge
    hw.evaluate(routes)
    assert hw.factor("hw-slow", "2") == 1.0
    _feed(hw, "hw-slow", "2", 30, ms=500.0)
    hw.evaluate(routes)
    assert hw.factor("hw-slow", "2") == 0.5
    assert "p99" in (hw.unhealthy_reason("hw-slow", "2", "1") or "")
    # Within ratio x stable + slack: healthy.
    clock.t += 11
    _feed(hw, "hw-slow", "1", 100, ms=10.0)
    _feed(hw, "hw-slow", "2", 100, ms=24.0)
    assert hw.unhealthy_reason("hw-slow", "2", "1") is None


def test_audit_records_feed_the_windows_and_what_is_not_the_versions_doing_is_not_counted() -> None:
    hw = HealthWeights(POLICY, Clock())

    def rec(version: str, status: str) -> bytes:
        return audit_record("hw-audit", version, status, latency_ms=3.0)

    for status in ("OK", "INTERNAL", "INVALID_ARGUMENT"):
        hw.observe(rec("2", status))
    # The gateway batches records, one per line; a malformed line loses only itself.
    batch = [rec("2", "UNAVAILABLE"), b"not json", rec("2", "CANCELLED"), rec("2", "NOT_FOUND")]
    hw.observe(b"\n".join(batch))
    hw.observe(rec("", "RESOURCE_EXHAUSTED"))  # refused before a version: not counted
    hw.observe(b"not json")
    # Counted: OK, INTERNAL, INVALID_ARGUMENT, UNAVAILABLE; not CANCELLED, NOT_FOUND.
    n, err, p99 = hw.stats("hw-audit", "2")
    assert (n, err, p99) == (4, 0.75, 3.0)


def test_windows_of_routes_that_are_gone_are_forgotten() -> None:
    hw = HealthWeights(POLICY, Clock())
    route = _route("hw-gone")
    _feed(hw, "hw-gone", "1", 50)
    _feed(hw, "hw-gone", "2", 50, errors=50)
    hw.evaluate({route.model: route})
    assert hw.factor("hw-gone", "2") == 0.5
    hw.evaluate({})
    assert hw.factor("hw-gone", "2") == 1.0
    assert hw.stats("hw-gone", "2") == (0, 0.0, 0.0)
    assert _gauge("inferbus_router_effective_weight", "hw-gone", "2") is None


def test_a_promoted_canary_forgets_its_factor() -> None:
    hw = HealthWeights(POLICY, Clock())
    route = _route("hw-promo")
    _feed(hw, "hw-promo", "1", 50)
    _feed(hw, "hw-promo", "2", 50, errors=50)
    hw.evaluate({route.model: route})
    assert hw.factor("hw-promo", "2") == 0.5
    promoted = route.model_copy(update={"stable": "2", "canary": "", "canary_weight": 0.0})
    hw.evaluate({route.model: promoted})
    assert hw.factor("hw-promo", "2") == 1.0
    assert _gauge("inferbus_router_canary_health_factor", "hw-promo", "2") is None
    assert _gauge("inferbus_router_effective_weight", "hw-promo", "2") == 100.0


def test_one_slow_request_among_few_does_not_cut_a_healthy_canary(caplog) -> None:
    """The flap of issue 21: a 10 % canary cut on "p99 77.5 ms vs 35.6 ms" from ~30
    samples, one of them a slow first request. One outlier is no evidence."""
    hw = HealthWeights(HealthPolicy(window_s=30.0, min_samples=30, warmup_samples=0), Clock())
    route = _route("hw-noise")
    _feed(hw, "hw-noise", "1", 270, ms=35.0)
    hw.record("hw-noise", "2", False, 77.5)
    _feed(hw, "hw-noise", "2", 29, ms=35.0)
    with caplog.at_level("INFO", logger="inferbus_router.health"):
        for _ in range(5):
            hw.evaluate({route.model: route})
    assert hw.factor("hw-noise", "2") == 1.0
    assert not hw.verdict("hw-noise", "2", "1").worse
    # Nothing moved, so nothing is logged (no "factor 1.00 → 1.00").
    assert not [r for r in caplog.records if "factor" in r.getMessage()]


def test_warm_up_latencies_of_a_fresh_version_are_not_counted() -> None:
    policy = HealthPolicy(window_s=30.0, min_samples=20, warmup_samples=10)
    hw = HealthWeights(policy, Clock())
    route = _route("hw-warm")
    _feed(hw, "hw-warm", "1", 100, ms=10.0)
    _feed(hw, "hw-warm", "2", 10, ms=900.0)  # the first ten: cold caches
    _feed(hw, "hw-warm", "2", 40, ms=10.0)
    # They count as requests (a failing version is judged as fast), not as latencies.
    assert hw.stats("hw-warm", "2") == (50, 0.0, 10.0)
    hw.evaluate({route.model: route})
    assert hw.factor("hw-warm", "2") == 1.0


def test_recovery_ends_exactly_at_one_and_then_logs_nothing(caplog) -> None:
    policy = HealthPolicy(window_s=10.0, min_samples=20, recover_step=0.1, warmup_samples=0)
    clock = Clock()
    hw = HealthWeights(policy, clock)
    route = _route("hw-snap")
    _feed(hw, "hw-snap", "1", 100)
    _feed(hw, "hw-snap", "2", 40, errors=40)
    hw.evaluate({route.model: route})
    assert hw.factor("hw-snap", "2") == 0.5
    clock.t += 11  # the bad records leave the window
    caplog.clear()
    with caplog.at_level("INFO", logger="inferbus_router.health"):
        for _ in range(8):
            hw.evaluate({route.model: route})
    assert hw.factor("hw-snap", "2") == 1.0
    moves = [r.getMessage() for r in caplog.records if "factor" in r.getMessage()]
    assert moves == [
        "canary weight factor 0.50 → 0.60",
        "canary weight factor 0.60 → 0.70",
        "canary weight factor 0.70 → 0.80",
        "canary weight factor 0.80 → 0.90",
        "canary weight factor 0.90 → 1.00",
    ]
