"""Answering a `ModelRunner`'s requests: replies, errors, terminated batches, metrics.

Every request gets exactly one reply, published before its micro-batch is
acked (`inferbus_worker.runner`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg

from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.microbatch import BatchEntry
from inferbus_worker import metrics
from inferbus_worker.microbatch import BatchReplies, LiveRequest, Outbox, ReplyContext
from inferbus_worker.stats import VersionCounters

log = logging.getLogger(__name__)


class Answering:
    """Replies and their metrics (a mixin of `ModelRunner`, which sets the attributes
    below)."""

    _nc: Client
    _config: ModelConfig
    _reply_ctx: ReplyContext
    _labels: dict[str, str]
    _children: dict[tuple[object, ...], Any]
    _log_extra: dict[str, str]
    stats: VersionCounters

    async def _terminate_garbage(self, msg: Msg) -> None:
        # Nobody can be answered: the reply subjects are inside the garbage.
        log.error("terminating an undecodable micro-batch", extra=self._log_extra)
        await msg.term()
        metrics.BATCHES.labels(**self._labels, outcome="garbage").inc()

    async def _send(self, outbox: Outbox) -> None:
        """Publish a run's answers and count them by status."""
        await outbox.send(self._nc)
        for status, n in outbox.counts.items():
            self._metric(metrics.REPLIES, status=status).inc(n)
        self.stats.failed(len(outbox) - outbox.counts.get("OK", 0))

    async def _fail_all(self, entries: list[BatchEntry], code: StatusCode, message: str) -> None:
        outbox = Outbox(self._reply_ctx)
        for entry in entries:
            outbox.error(entry, code, message)
        await self._send(outbox)

    def _metric(self, metric: Any, **extra: str) -> Any:
        """`metric`'s child for this version (and `extra` labels), cached: ``labels()``
        with keyword arguments costs a few µs, and replies count once per request."""
        key = (metric, *extra.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **extra)
        return child

    def _observe(self, requests: list[LiveRequest], rows: int, start_ns: int, compute_s: float):
        self._metric(metrics.ROWS).inc(rows)
        self._metric(metrics.BATCH_SIZE).observe(rows)
        self._metric(metrics.COMPUTE_SECONDS).observe(compute_s)
        queue_hist = self._metric(metrics.QUEUE_SECONDS)
        for r in requests:
            if r.entry.enqueued_ns:
                queue_hist.observe(max(0.0, (start_ns - r.entry.enqueued_ns) / 1e9))

    async def _answer(
        self,
        requests: list[LiveRequest],
        outputs: dict[str, np.ndarray],
        rows: int,
        start_ns: int,
        compute_s: float,
        *,
        stages: dict[str, float] | None = None,
    ) -> None:
        replies = BatchReplies(
            outputs,
            batched=self._config.max_batch_size > 0,
            compute_ms=compute_s * 1000,
            stages_ms=stages,
        )
        outbox = Outbox(self._reply_ctx, replies.shared_timings, rows)
        for r in requests:
            entry = r.entry
            queue_ms = max(0.0, (start_ns - entry.enqueued_ns) / 1e6) if entry.enqueued_ns else 0.0
            try:
                outbox.ok(entry, queue_ms, replies.frame_parts(r))
            except InvalidArgument as exc:
                outbox.error(entry, StatusCode.INVALID_ARGUMENT, exc.message)
        await self._send(outbox)

    async def _poison(
        self, msgs: list[Msg], entries: list[BatchEntry], code: StatusCode, message: str
    ) -> None:
        """Answer every request with an error and terminate the batches (no redelivery)."""
        log.warning("terminating a micro-batch: %s", message, extra=self._log_extra)
        await self._fail_all(entries, code, message)
        for msg in msgs:
            await msg.term()
        outcome = "invalid" if code is StatusCode.INVALID_ARGUMENT else "failed"
        metrics.BATCHES.labels(**self._labels, outcome=outcome).inc(len(msgs))
