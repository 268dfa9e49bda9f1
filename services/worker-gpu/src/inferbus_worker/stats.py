"""Cumulative inference statistics of one served version, for Triton's statistics extension.

The `ModelRunner` calls `VersionCounters.executed` once per answered engine
execution and `VersionCounters.failed` once per batch of answers sent (with
the number of errors among them); both are a few integer additions on the
event loop (no lock: the runner updates them from
there only). The heartbeat puts `snapshot` in the worker's status record and
gateways sum the live workers' records (`inferbus_common.modelstats`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from inferbus_common.modelstats import Duration, ModelStats
from inferbus_worker.microbatch import LiveRequest


class VersionCounters:
    """Counters of one version on this worker since the runner started."""

    __slots__ = (
        "_batches",
        "_executions",
        "_fail",
        "_infer",
        "_input",
        "_last_ms",
        "_output",
        "_queue",
        "_rows",
        "_success",
    )

    def __init__(self) -> None:
        self._rows = 0
        self._executions = 0
        self._last_ms = 0
        # [count, ns] pairs.
        self._success = [0, 0]
        self._fail = [0, 0]
        self._queue = [0, 0]
        self._input = [0, 0]
        self._infer = [0, 0]
        self._output = [0, 0]
        self._batches: dict[int, list[int]] = {}

    def executed(
        self,
        requests: Sequence[LiveRequest],
        start_ns: int,
        infer_s: float,
        stages_ms: Mapping[str, float],
        done_s: float,
    ) -> None:
        """Record an execution whose requests were all answered OK.

        Args:
            requests: the requests computed and answered.
            start_ns: unix ns when the engine run started (queue time ends).
            infer_s: the engine run's duration.
            stages_ms: stage timings; ``pre`` is the input preparation.
            done_s: from the engine run's start until every reply was sent.
        """
        now_ns = time.time_ns()
        n = len(requests)
        rows = 0
        waited = answered = 0
        for r in requests:
            entry = r.entry
            rows += entry.rows
            enqueued = entry.enqueued_ns or start_ns
            waited += max(0, start_ns - enqueued)
            answered += max(0, now_ns - enqueued)
        input_ns = round(stages_ms.get("pre", 0.0) * 1e6)
        infer_ns = round(infer_s * 1e9)
        output_ns = max(0, round((done_s - infer_s) * 1e9))
        self._rows += rows
        self._executions += 1
        self._last_ms = now_ns // 1_000_000
        self._success[0] += n
        self._success[1] += answered
        self._queue[0] += n
        self._queue[1] += waited
        self._input[0] += n
        self._input[1] += n * input_ns
        self._infer[0] += n
        self._infer[1] += n * infer_ns
        self._output[0] += n
        self._output[1] += n * output_ns
        batch = self._batches.get(rows)
        if batch is None:
            batch = self._batches[rows] = [0, 0, 0, 0]
        batch[0] += 1
        batch[1] += input_ns
        batch[2] += infer_ns
        batch[3] += output_ns

    def failed(self, count: int) -> None:
        """Record `count` requests answered with an error (their durations are not
        measured: Triton's ``fail.ns`` stays 0)."""
        self._fail[0] += count

    def snapshot(self) -> ModelStats:
        """The counters now, as the heartbeat record carries them."""
        return ModelStats(
            inference_count=self._rows,
            execution_count=self._executions,
            last_inference_ms=self._last_ms,
            success=Duration(count=self._success[0], ns=self._success[1]),
            fail=Duration(count=self._fail[0], ns=self._fail[1]),
            queue=Duration(count=self._queue[0], ns=self._queue[1]),
            compute_input=Duration(count=self._input[0], ns=self._input[1]),
            compute_infer=Duration(count=self._infer[0], ns=self._infer[1]),
            compute_output=Duration(count=self._output[0], ns=self._output[1]),
            batches={size: list(v) for size, v in self._batches.items()},
        )
