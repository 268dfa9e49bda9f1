"""The runner's calls of a version's ``preprocessor.py`` (issue 27): a mixin of `ModelRunner`.

``preprocess`` runs on the merged batch before the engine, ``postprocess``
on the engine's outputs after it, each in the version's `ScriptPool`
(`inferbus_worker.scriptpool`), timed as the ``pre`` and ``post`` stages.
The deadline of both is the batch's earliest request deadline less
``script_reply_margin_ms`` (``script_timeout_s`` from the start of the batch
when no request has one).
A failure (timeout, crash, exception, a result that does not fit the
config) answers every request of the batch ``INTERNAL`` with one line naming
the version and what happened, and terminates the batch: redelivering it
would run the same code on the same rows again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from nats.aio.msg import Msg

from inferbus_common.errors import StatusCode
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import BatchEntry
from inferbus_worker import metrics
from inferbus_worker.microbatch import LiveRequest
from inferbus_worker.scriptpool import ScriptFailure, ScriptProcessing


def batch_deadline(requests: list[LiveRequest], default_s: float, margin_s: float) -> float:
    """``time.monotonic()`` deadline of a batch: its earliest request deadline, less
    `margin_s` so the INTERNAL answer of a cut batch reaches the gateway before the
    gateway's own timer answers DEADLINE_EXCEEDED; `default_s` from now without one."""
    now_ns = h.now_ns()
    now = time.monotonic()
    deadlines = [r.entry.deadline_ns for r in requests if r.entry.deadline_ns]
    if not deadlines:
        return now + default_s
    return now + (min(deadlines) - now_ns) / 1e9 - margin_s


class ScriptExecution:
    """Runs a version's Python pre/post-processing (a mixin of `ModelRunner`)."""

    _script: ScriptProcessing | None
    _script_timeout_s: float
    _script_margin_s: float
    _labels: dict[str, str]

    if TYPE_CHECKING:

        async def _poison(
            self, msgs: list[Msg], entries: list[BatchEntry], code: StatusCode, message: str
        ) -> None: ...

    async def _script_stage(
        self,
        stage: str,
        msgs: list[Msg],
        tensors: dict[str, np.ndarray],
        requests: list[LiveRequest],
        stages: dict[str, float],
        deadline: float,
    ) -> dict[str, np.ndarray] | None:
        """``preprocess`` (stage ``pre``) or ``postprocess`` (``post``) of a batch;
        None when it failed and the batch has been answered and terminated."""
        assert self._script is not None
        rows = sum(r.entry.rows for r in requests)
        run = self._script.pre if stage == "pre" else self._script.post
        t0 = time.perf_counter()
        try:
            result = await run(tensors, rows, deadline)
        except ScriptFailure as exc:
            await self._poison(msgs, [r.entry for r in requests], StatusCode.INTERNAL, exc.message)
            return None
        seconds = time.perf_counter() - t0
        stages[stage] = seconds * 1000
        metrics.PROCESSING_SECONDS.labels(**self._labels, stage=stage).observe(seconds)
        return result
