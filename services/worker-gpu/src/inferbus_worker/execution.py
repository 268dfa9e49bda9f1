"""Engine execution of a `ModelRunner`: inline or in the thread pool, pre/post-processing.

Short runs inline: handing a micro-batch to an engine thread and back costs
a few hundred microseconds on a busy machine (executor hand-off, loop wake-up,
GIL), far more than a tiny model's run. `InlineRuns` keeps a moving average of
the engine's run time per batch-size class; a batch whose class recently ran
under ``inline_run_max_us`` runs on the event loop, anything else (and any
class not measured yet) in the thread pool. GPU engines always use the pool.

Pre/post-processing (`inferbus_worker.processing`, when the version's config
declares it) runs on the merged batch around the engine, in the same thread
pool, timed as the ``pre`` and ``post`` stages of ``Ib-Timings``. Requests
whose rows fail pre-processing are answered ``INVALID_ARGUMENT`` before the
engine runs; the rest of the batch is computed as usual. (If the engine then
fails and the batch is redelivered, those requests are answered again; the
gateway keeps the first answer.)
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
from nats.aio.msg import Msg

from inferbus_common.errors import StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker import metrics
from inferbus_worker.engines import Engine
from inferbus_worker.isolation import run_alone
from inferbus_worker.microbatch import LiveRequest, Outbox, ReplyContext
from inferbus_worker.processing import Processing


def runs_on_gpu(engine: Engine) -> bool:
    """Whether `engine` really computes on a GPU (its `Engine.device_kind`)."""
    return engine.device_kind == "gpu"


class InlineRuns:
    """Decides whether an engine run is short enough to run on the event loop.

    Run times are kept as a moving average per batch-size class (rows 1, 2-3,
    4-7, ...: a model's time per batch is far from proportional to its rows).
    A class with no measurement yet runs in the thread pool, and its first
    runs there measure it; every run, inline or not, updates its class, so a
    model that slows down (a busy machine, a bigger input) goes back to the
    threads after a run or a few.

    Args:
        max_s: longest average run time that still runs inline; 0 disables.
        alpha: weight of the newest run in the moving average.
    """

    def __init__(self, max_s: float, *, alpha: float = 0.2) -> None:
        self.max_s = max_s
        self._alpha = alpha
        self._avg: dict[int, float] = {}

    @staticmethod
    def _key(rows: int) -> int:
        return max(rows, 1).bit_length()

    def inline(self, rows: int) -> bool:
        """True when a batch of `rows` rows should run on the event loop."""
        if self.max_s <= 0:
            return False
        avg = self._avg.get(self._key(rows))
        return avg is not None and avg <= self.max_s

    def observe(self, rows: int, seconds: float) -> None:
        """Record one engine run of `rows` rows that took `seconds`."""
        key = self._key(rows)
        avg = self._avg.get(key)
        self._avg[key] = seconds if avg is None else avg + self._alpha * (seconds - avg)

    def average(self, rows: int) -> float | None:
        """Moving average run time of the class of `rows` (None: not measured)."""
        return self._avg.get(self._key(rows))


def _timed_run(
    engine: Engine, inputs: dict[str, np.ndarray], outputs: list[str]
) -> tuple[dict[str, np.ndarray], float]:
    """`engine.run` and its duration in seconds (measured where it runs)."""
    t0 = time.perf_counter()
    result = engine.run(inputs, outputs)
    return result, time.perf_counter() - t0


class EngineExecution:
    """Runs the engine and the processing steps on a batch (a mixin of `ModelRunner`,
    which sets the attributes below)."""

    _engine: Engine
    _pool: ThreadPoolExecutor
    _inline: InlineRuns
    _outputs: list[str]
    _processing: Processing | None
    _config: ModelConfig
    _labels: dict[str, str]
    _reply_ctx: ReplyContext

    if TYPE_CHECKING:

        def _metric(self, metric: Any, **extra: str) -> Any: ...

        async def _send(self, outbox: Outbox) -> None: ...

    async def _compute(
        self, msgs: list[Msg], inputs: dict[str, np.ndarray], rows: int
    ) -> dict[str, np.ndarray]:
        if self._inline.inline(rows):
            # Short: running it here costs less than the hand-off to a thread and back.
            outputs, seconds = _timed_run(self._engine, inputs, self._outputs)
            self._inline.observe(rows, seconds)
            self._metric(metrics.INLINE_RUNS).inc()
            return outputs
        loop = asyncio.get_running_loop()
        # `_keepalive` tells JetStream meanwhile that the batch is still worked on.
        outputs, seconds = await loop.run_in_executor(
            self._pool, _timed_run, self._engine, inputs, self._outputs
        )
        self._inline.observe(rows, seconds)
        return outputs

    async def _run_alone(
        self, inputs: dict[str, np.ndarray], requests: list[LiveRequest]
    ) -> tuple[dict[str, np.ndarray], list[LiveRequest]]:
        """After the engine refused the batch: each request alone (`isolation.run_alone`).

        Answers the requests that fail alone; returns the outputs and requests
        of those that computed.
        """
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self._pool, run_alone, self._engine, inputs, requests, self._outputs
        )
        outbox = Outbox(self._reply_ctx)
        for r, code, message in result.rejected:
            outbox.error(r.entry, code, message)
        await self._send(outbox)
        return result.outputs, result.requests

    async def _preprocess(
        self,
        inputs: dict[str, np.ndarray],
        requests: list[LiveRequest],
        stages: dict[str, float],
    ) -> tuple[dict[str, np.ndarray], list[LiveRequest]]:
        """Run the pre steps on the whole batch; answer the requests whose rows failed.

        Failed rows stay in the engine inputs (zero-filled, so the batch keeps
        its shape); their requests are answered ``INVALID_ARGUMENT`` here and
        left out of the returned requests, so their results are never sent.
        """
        assert self._processing is not None
        rows = sum(r.entry.rows for r in requests)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._pool, self._processing.pre, inputs, rows)
        stages["pre"] = result.seconds * 1000
        metrics.PROCESSING_SECONDS.labels(**self._labels, stage="pre").observe(result.seconds)
        if not result.row_errors:
            return result.inputs, requests
        kept = []
        outbox = Outbox(self._reply_ctx)
        for r in requests:
            bad = next((i for i in range(r.start, r.stop) if i in result.row_errors), None)
            if bad is None:
                kept.append(r)
                continue
            message = f"{self._config.name}: row {bad - r.start}: {result.row_errors[bad]}"
            outbox.error(r.entry, StatusCode.INVALID_ARGUMENT, message)
        await self._send(outbox)
        return result.inputs, kept

    async def _postprocess(
        self, outputs: dict[str, np.ndarray], stages: dict[str, float]
    ) -> dict[str, np.ndarray]:
        """Run the post steps on the whole batch's engine outputs."""
        assert self._processing is not None
        loop = asyncio.get_running_loop()
        outputs, seconds = await loop.run_in_executor(self._pool, self._processing.post, outputs)
        stages["post"] = seconds * 1000
        metrics.PROCESSING_SECONDS.labels(**self._labels, stage="post").observe(seconds)
        return outputs
