"""The fault matrix (issue #11, item 1): each fault under steady closed-loop
load; every request gets exactly one answer, a correct one or an explicit
error before its deadline; none is lost, none hangs; the services reconnect
by themselves and the time to full recovery is measured.

The same runs, longer, make the table in ``docs/reliability.md``
(``uv run python bench/reliability.py``).
"""

from __future__ import annotations

import pytest

from inferbus_testing.chaos import FAULTS, ChaosStack, Shape, assert_nothing_lost, run_fault

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.mark.parametrize("name", list(FAULTS))
async def test_fault_loses_nothing_and_recovers(chaos_stack: ChaosStack, name: str) -> None:
    assert all(chaos_stack.alive().values()), chaos_stack.alive()
    report = await run_fault(chaos_stack, FAULTS[name], Shape.ci())
    for service, error in chaos_stack.start_crashes:
        print(f"NOTE: {service} crashed while restarting (started again):\n{error}")
    assert_nothing_lost(report)
    # Every service is up again (nothing crashed as a side effect) and serving
    # fully: the last second of the run was all correct answers.
    assert all(report.alive.values()), report.alive
    assert report.recovered_s is not None, report.samples
    assert report.first_ok_s is not None
    # A fault that takes nothing away from the data path costs nothing.
    if name in (
        "kill-worker",
        "kill-busy-worker",
        "kill-gateway",
        "restart-redis",
        "stop-registry-s3",
    ):
        assert report.correct == report.sent, report.samples
    if name == "kill-busy-worker":
        # What the dead worker held comes back after the 0.5 s first ack wait, not
        # at the 2 s deadline (issue 18); the bound leaves a loaded CI machine room.
        assert report.in_flight_answered_s is not None and report.in_flight_answered_s < 1.5
