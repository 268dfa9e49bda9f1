"""Overload (issue #11, item 2): open-loop load at 2x and 5x the measured
capacity of a compute-bound model. Admitted requests finish within their
deadline (p99), the excess is refused fast with RESOURCE_EXHAUSTED and a
reason, the memory of every service stays bounded, and throughput is back to
normal within seconds after the flood.

The work queue of a model is bounded (``INFERBUS_BATCHER_STREAM_MAX_MSGS_PER_SUBJECT``,
set by `inferbus_testing.chaos.environment` to what two workers of this model
drain well within a deadline); that bound turns the excess into fast
refusals instead of waiting.
"""

from __future__ import annotations

import pytest

from inferbus_testing.chaos import ChaosStack
from inferbus_testing.overload import measure_capacity, run_flood

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

MODEL = "slow"
DEADLINE_S = 2.0
FLOOD_S = 3.0


@pytest.mark.parametrize("factor", [2.0, 5.0])
async def test_open_loop_overload_is_refused_fast_and_recovers(
    chaos_stack: ChaosStack, factor: float
) -> None:
    capacity = await measure_capacity(chaos_stack, MODEL, seconds=2.0)
    assert capacity > 5, f"capacity {capacity:.1f} req/s: the stack is not serving"
    flood = await run_flood(
        chaos_stack,
        MODEL,
        rate=factor * capacity,
        seconds=FLOOD_S,
        deadline_s=DEADLINE_S,
        capacity_rps=capacity,
    )
    print(flood.row())
    assert flood.hung == 0, flood.samples
    assert flood.lost == 0, flood.row()
    assert set(flood.statuses) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, flood.samples
    # The excess is refused, fast, with a reason.
    assert flood.statuses.get("RESOURCE_EXHAUSTED", 0) > 0.2 * flood.sent, flood.row()
    assert flood.reject_p50_s < 0.5, flood.row()
    assert flood.refusals_without_reason == 0, flood.samples
    # What was admitted finished within its deadline.
    assert flood.statuses.get("OK", 0) > 0, flood.row()
    assert flood.ok_p99_s < DEADLINE_S, flood.row()
    # Few admitted requests wait out their deadline: the bound refuses instead.
    assert flood.statuses.get("DEADLINE_EXCEEDED", 0) <= 0.1 * flood.sent, flood.row()
    # Memory: no service grew by more than 200 MiB during the flood.
    assert flood.rss_growth_max_mib < 200, flood.rss_growth_mib
    # Back to normal within seconds.
    assert flood.recovery_s is not None, flood.row()
    assert flood.recovery_s < 10.0, flood.row()
