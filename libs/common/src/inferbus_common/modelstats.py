"""Per-version inference statistics: what workers report and gateways add up.

Each worker keeps cumulative counters for every version it serves and puts
them in its heartbeat record (`catalogrecords.WorkerStatus.stats`, the workers
bucket). A gateway answering Triton's statistics extension sums the records
of the live workers (`sum_stats`) and shapes the sum as Triton does
(`inferbus_gateway.triton.documents`). Counters are cumulative over a worker's
life: when a worker leaves (drained, or its heartbeat goes stale), its counts
leave the sums. docs/architecture.md ("Triton's protocol extensions") says
what each field measures.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, Field


class Duration(BaseModel):
    """How many events, and their total duration."""

    count: int = 0
    ns: int = 0

    def add(self, other: Duration) -> None:
        """Add `other` into this one."""
        self.count += other.count
        self.ns += other.ns


_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class ModelStats(BaseModel):
    """Cumulative statistics of one model version on one worker (or summed).

    Per request: `success`, `fail`, `queue`, and the `compute_*` stages (each
    request is charged its whole execution's stage times, as Triton does).
    Per execution: `execution_count` and `batches`.
    """

    inference_count: int = 0
    """Rows computed and answered OK (a batch of 4 rows counts 4)."""
    execution_count: int = 0
    """Engine executions (micro-batches, merged ones counting once)."""
    last_inference_ms: int = 0
    """Unix ms of the last answered execution (0: none)."""
    success: Duration = Field(default_factory=Duration)
    """Requests answered OK; ns from the batcher accepting them to the reply."""
    fail: Duration = Field(default_factory=Duration)
    """Requests the worker answered with an error (ns not measured: 0)."""
    queue: Duration = Field(default_factory=Duration)
    """Waiting: from the batcher accepting the request to its execution's start."""
    compute_input: Duration = Field(default_factory=Duration)
    """Preparing the engine's inputs (pre-processing)."""
    compute_infer: Duration = Field(default_factory=Duration)
    """The engine run."""
    compute_output: Duration = Field(default_factory=Duration)
    """From the engine's outputs to the replies sent (post-processing, encoding)."""
    batches: dict[int, list[int]] = Field(default_factory=dict)
    """Rows of an execution → ``[executions, input_ns, infer_ns, output_ns]``."""

    def add(self, other: ModelStats) -> None:
        """Add `other` into this one (the latest `last_inference_ms` wins)."""
        self.inference_count += other.inference_count
        self.execution_count += other.execution_count
        self.last_inference_ms = max(self.last_inference_ms, other.last_inference_ms)
        for name in _DURATIONS:
            getattr(self, name).add(getattr(other, name))
        for size, values in other.batches.items():
            mine = self.batches.setdefault(size, [0, 0, 0, 0])
            for i, v in enumerate(values[:4]):
                mine[i] += v


def sum_stats(records: Iterable[ModelStats]) -> ModelStats:
    """The sum of several workers' statistics of one version."""
    total = ModelStats()
    for record in records:
        total.add(record)
    return total
