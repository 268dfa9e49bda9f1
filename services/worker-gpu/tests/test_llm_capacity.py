"""`Capacity`: when a generative request would start and end, from recent requests."""

from __future__ import annotations

import pytest

from inferbus_common.errors import ResourceExhausted
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_from_reply, error_headers
from inferbus_worker.llm.capacity import Capacity


def test_nothing_known_estimates_nothing() -> None:
    cap = Capacity(slots=4)
    assert not cap.known
    est = cap.estimate(in_flight=10, max_tokens=100)
    assert est.ahead == 7 and est.done_s == 0.0


def test_a_request_waits_for_the_slots_ahead_of_it() -> None:
    cap = Capacity(slots=4)
    cap.observe(prefill_s=0.1, per_token_s=0.01, hold_s=2.0)
    # A free slot: no wait, only its own run.
    free = cap.estimate(in_flight=3, max_tokens=50)
    assert (free.ahead, free.wait_s) == (0, 0.0)
    assert free.run_s == pytest.approx(0.1 + 50 * 0.01)
    # Four running, four waiting: it is 5th in line; a slot frees every 0.5 s.
    queued = cap.estimate(in_flight=8, max_tokens=50)
    assert queued.ahead == 5
    assert queued.wait_s == pytest.approx(2.5)
    assert queued.done_s == pytest.approx(2.5 + 0.6)


def test_the_averages_follow_recent_requests() -> None:
    cap = Capacity(slots=1, alpha=0.5)
    cap.observe(prefill_s=1.0, per_token_s=1.0, hold_s=1.0)
    cap.observe(prefill_s=3.0, per_token_s=3.0, hold_s=3.0)
    assert (cap.prefill_s, cap.per_token_s, cap.hold_s) == (2.0, 2.0, 2.0)
    assert cap.samples == 2
    with pytest.raises(ValueError):
        Capacity(slots=0)


def test_the_retry_hint_crosses_the_bus() -> None:
    exc = ResourceExhausted("late", reason="llm-late", retry_after_s=7.25)
    headers = error_headers(exc, "r1")
    assert headers[h.RETRY_AFTER] == "7.250"
    back = error_from_reply(headers)
    assert isinstance(back, ResourceExhausted)
    assert (back.reason, back.retry_after_s) == ("llm-late", 7.25)
    headers[h.RETRY_AFTER] = "soon"
    back = error_from_reply(headers)
    assert isinstance(back, ResourceExhausted) and back.retry_after_s == 1.0
