"""Faults with every client calling through the gRPC edge (``services/edge``).

Behind the edge a client has one address, so it cannot fail over to another
gateway itself: when the gateway holding its call dies, the edge must answer.
Each fault runs under steady closed-loop load, as in ``test_chaos_faults.py``;
every request gets exactly one answer, a correct one or an explicit error
before its deadline, none is lost, none hangs. The same runs, longer, are the
edge's table in ``docs/reliability.md``.
"""

from __future__ import annotations

import pytest

from inferbus_testing.chaos import EDGE_FAULTS, ChaosStack, Shape, assert_nothing_lost, run_fault

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.mark.parametrize("name", list(EDGE_FAULTS))
async def test_fault_through_the_edge_loses_nothing_and_recovers(
    chaos_stack: ChaosStack, name: str
) -> None:
    assert all(chaos_stack.alive().values()), chaos_stack.alive()
    report = await run_fault(chaos_stack, EDGE_FAULTS[name], Shape.ci(), through_edge=True)
    assert_nothing_lost(report)
    assert all(report.alive.values()), report.alive
    assert report.recovered_s is not None, report.samples
    if name == "edge-kill-gateway":
        # The calls the killed gateway held are answered UNAVAILABLE once no
        # gateway has claimed them for the edge's orphan time (1 s) and retried;
        # before claims they waited out the client's whole deadline (2 s + 1 s).
        assert report.correct == report.sent, report.samples
        assert report.in_flight_answered_s is not None and report.in_flight_answered_s < 1.8
    if name == "edge-kill-worker":
        assert report.correct == report.sent, report.samples
