"""Health-aware canary weights: windows, thresholds, floor and recovery."""

from __future__ import annotations

from prometheus_client import REGISTRY

from inferbus_common.catalog import Route
from inferbus_router.health import HealthPolicy, HealthWeights
from inferbus_testing.records import audit_record

POLICY = HealthPolicy(window_s=10.0, min_samples=20, floor=0.1, decrease=0.5, recover_step=0.25)


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


def test_audit_records_feed_the_windows_and_callers_faults_do_not_count() -> None:
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
    n, err, p99 = hw.stats("hw-audit", "2")
    assert (n, err, p99) == (6, 0.5, 3.0)


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
