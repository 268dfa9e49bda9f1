"""`VersionCounters`: what one execution and one error reply add to a version's statistics."""

from __future__ import annotations

import time

from inferbus_common.modelstats import Duration
from inferbus_common.protocol.microbatch import BatchEntry
from inferbus_worker.microbatch import LiveRequest
from inferbus_worker.stats import VersionCounters


def test_an_execution_and_a_failure_add_up() -> None:
    counters = VersionCounters()
    start_ns = time.time_ns()
    requests = [
        LiveRequest(BatchEntry("a", "r.a", 0, start_ns - 3_000_000, 2), 0),
        LiveRequest(BatchEntry("b", "r.b", 0, start_ns - 1_000_000, 1), 2),
    ]
    counters.executed(requests, start_ns, infer_s=0.004, stages_ms={"pre": 0.5}, done_s=0.005)
    counters.executed(requests[:1], start_ns, infer_s=0.002, stages_ms={}, done_s=0.002)
    counters.failed(0)
    counters.failed(2)
    stats = counters.snapshot()
    assert stats.inference_count == 5
    assert stats.execution_count == 2
    assert stats.last_inference_ms >= start_ns // 1_000_000
    # Per request: 3 requests answered, each charged its execution's stage times.
    assert stats.queue == Duration(count=3, ns=3_000_000 + 1_000_000 + 3_000_000)
    assert stats.compute_infer == Duration(count=3, ns=2 * 4_000_000 + 2_000_000)
    assert stats.compute_input == Duration(count=3, ns=2 * 500_000)
    assert stats.compute_output == Duration(count=3, ns=2 * 1_000_000)
    assert stats.success.count == 3
    assert stats.success.ns >= 3_000_000 + 1_000_000 + 3_000_000
    assert stats.fail == Duration(count=2, ns=0)
    # Per execution, under its rows: [executions, input, infer, output] ns.
    assert stats.batches == {3: [1, 500_000, 4_000_000, 1_000_000], 2: [1, 0, 2_000_000, 0]}
