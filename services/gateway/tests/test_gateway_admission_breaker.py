"""Circuit breaker transitions, on an injected clock (no sleeping)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from inferbus_common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from inferbus_gateway.admission.breaker import (
    BreakerBoard,
    BreakerState,
    CircuitBreaker,
    counts_as_failure,
)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, model: str = "fraud", **kw: object) -> CircuitBreaker:
    options: dict[str, object] = {
        "window_s": 10.0,
        "buckets": 10,
        "min_requests": 10,
        "failure_rate": 0.5,
        "open_s": 5.0,
        "half_open_probes": 2,
        "clock": clock,
    }
    options.update(kw)
    return CircuitBreaker(model, **options)  # type: ignore[arg-type]


def gauge(model: str) -> float | None:
    return REGISTRY.get_sample_value("inferbus_gateway_breaker_state", {"model": model})


def test_stays_closed_below_min_requests() -> None:
    clock = Clock()
    b = make(clock, "m1")
    for _ in range(9):
        b.allow()
        b.record_failure()
    assert b.state is BreakerState.CLOSED


def test_opens_on_error_rate_then_half_open_then_closes() -> None:
    clock = Clock()
    b = make(clock, "m2")
    for i in range(5):
        b.allow()
        b.record_failure(timeout=i % 2 == 0)
    for _ in range(5):
        b.allow()
        b.record_success()
    # The rate is checked when a failure arrives; at the 5th failure only 5 < 10
    # requests were in the window, so it is still closed.
    assert b.state is BreakerState.CLOSED
    b.allow()
    b.record_failure()
    assert b.window() == (11, 6, 3)
    assert b.state is BreakerState.OPEN
    assert gauge("m2") == 2
    with pytest.raises(Unavailable, match="circuit breaker is open"):
        b.allow()
    clock.now += 5.0
    b.allow()  # first probe
    assert b.state is BreakerState.HALF_OPEN
    assert gauge("m2") == 1
    b.allow()  # second probe
    with pytest.raises(Unavailable, match="probe"):
        b.allow()  # no third while two are out
    b.record_success()
    assert b.state is BreakerState.HALF_OPEN
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert gauge("m2") == 0
    assert b.window() == (0, 0, 0)


def test_failed_probe_reopens() -> None:
    clock = Clock()
    b = make(clock, "m3", min_requests=2, half_open_probes=1)
    for _ in range(2):
        b.allow()
        b.record_failure()
    assert b.state is BreakerState.OPEN
    clock.now += 5.0
    b.allow()
    b.record(Unavailable("still down"))
    assert b.state is BreakerState.OPEN
    clock.now += 4.9
    with pytest.raises(Unavailable):
        b.allow()
    clock.now += 0.1
    b.allow()
    b.record(None)
    assert b.state is BreakerState.CLOSED


def test_old_failures_leave_the_window() -> None:
    clock = Clock()
    b = make(clock, "m4")
    for _ in range(9):
        b.allow()
        b.record_failure()
    clock.now += 10.0  # all nine age out
    for _ in range(9):
        b.allow()
        b.record_success()
    b.allow()
    b.record_failure()
    assert b.window() == (10, 1, 0)
    assert b.state is BreakerState.CLOSED


def test_client_errors_do_not_count() -> None:
    assert counts_as_failure(None) is False
    assert counts_as_failure(DeadlineExceeded("late")) is True
    assert counts_as_failure(RuntimeError("bug")) is True
    assert counts_as_failure(InvalidArgument("bad shape")) is None
    clock = Clock()
    b = make(clock, "m5", min_requests=1, half_open_probes=1)
    for _ in range(5):
        b.allow()
        b.record(InvalidArgument("bad"))
    assert b.state is BreakerState.CLOSED and b.window() == (0, 0, 0)
    b.allow()
    b.record(DeadlineExceeded("late"))
    assert b.state is BreakerState.OPEN and b.window()[2] == 1
    clock.now += 5
    b.allow()
    b.record(InvalidArgument("bad"))  # frees the probe slot, decides nothing
    assert b.state is BreakerState.HALF_OPEN
    b.allow()
    b.record(None)
    assert b.state is BreakerState.CLOSED


def test_board_keeps_one_breaker_per_model() -> None:
    clock = Clock()
    board = BreakerBoard(min_requests=1, clock=clock)
    assert board.get("a") is board.get("a")
    board.get("a").allow()
    board.get("a").record_failure()
    assert board.get("a").state is BreakerState.OPEN
    assert board.get("b").state is BreakerState.CLOSED


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker("x", failure_rate=0)
    with pytest.raises(ValueError):
        CircuitBreaker("x", min_requests=0)
