"""The pull loop of a `ModelRunner`: fetch micro-batches per free slot, group them.

Merging: when a fetched micro-batch says more are waiting for the consumer
(JetStream's ``num_pending``), the runner takes those at once (a no-wait
pull) and joins batches with the same tensor signature up to
``max_batch_size`` rows into one engine execution. Under load the batches
that queued up while the engine was busy thus run as one full batch; when
idle nothing waits (the batcher may dispatch early and the engine still
fills). A merged group is acked, nak'ed or terminated as a whole; if the
engine rejects a merged input, each batch is retried alone so one bad batch
cannot fail its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from inferbus_common.batchrule import BatchRule
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.microbatch import MicroBatch, decode_batch
from inferbus_common.protocol.tensors import batch_signature
from inferbus_common.subjects import Subjects
from inferbus_worker.pull import ConsumerGone, PullConsumer
from inferbus_worker.settings import WorkerSettings

log = logging.getLogger(__name__)

NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, OSError)
"""Failures talking to NATS: transient, the batch is redelivered."""


class PullLoop:
    """Fetches micro-batches and plans their executions (a mixin of `ModelRunner`,
    which sets the attributes below)."""

    _nc: Client
    _js: JetStreamContext
    _subjects: Subjects
    _settings: WorkerSettings
    _puller: PullConsumer | None
    _consumer_config: ConsumerConfig | None
    _stopping: asyncio.Event
    _slot_freed: asyncio.Event
    _free: int
    _inflight: set[asyncio.Task[None]]
    _held: dict[int, tuple[Msg, float]]
    _merge_limit: int
    _batch_rule: BatchRule
    _idle_subject: str
    _idle_after_s: float
    _log_extra: dict[str, str]

    if TYPE_CHECKING:

        @property
        def consumer(self) -> str: ...

        async def _handle(self, group: list[tuple[Msg, MicroBatch | None]]) -> None: ...

    async def _pull_loop(self) -> None:
        assert self._puller is not None
        while not self._stopping.is_set():
            if self._free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                # One batch per free slot: a long poll for one returns as soon as a
                # batch is there, and leaves no pull open on the server that would
                # deliver batches nobody has a slot for. Nothing there within the
                # idle delay: tell the batchers (`_signal_idle`).
                msgs = await self._puller.fetch(
                    1,
                    self._settings.fetch_timeout_s,
                    on_idle=self._signal_idle,
                    idle_after_s=self._idle_after_s,
                )
            except ConsumerGone as exc:
                # Nobody answers pulls for the consumer: it (or its memory-storage
                # stream) went away with a nats-server restart. Create it again.
                log.warning(
                    "fetch failed: %r; re-creating the consumer", exc, extra=self._log_extra
                )
                await self._restore_consumer()
                continue
            except NATS_ERRORS as exc:
                log.warning("fetch failed: %s", exc, extra=self._log_extra)
                await asyncio.sleep(self._settings.fetch_timeout_s)
                continue
            if not msgs:
                continue  # no batch within the poll
            pending = msgs[-1].metadata.num_pending or 0
            if self._merge_limit > 1:
                if pending > 0:
                    msgs += await self._fetch_waiting(min(pending, self._merge_limit - 1))
            for group in self._plan(msgs):
                self._free -= 1
                task = asyncio.create_task(self._handle(group))
                self._inflight.add(task)
                task.add_done_callback(self._finished)

    async def _signal_idle(self) -> None:
        """A free slot and no batch waiting: requests for this version need not wait
        to fill a batch (the batchers dispatch at once on this signal). Sent only
        after a pull found nothing for `idle_signal_after_us`, so a busy worker,
        whose next batch is already there, sends none."""
        with contextlib.suppress(*NATS_ERRORS):
            await self._nc.publish(self._idle_subject, b"")

    async def _restore_consumer(self) -> None:
        """Create the durable consumer again (idempotent); wait a little if that fails.

        The pull subscription itself needs no change: pulls name the stream and
        consumer, replies come to its own inbox. When the stream is missing too,
        the batcher re-creates it on its next publish; until then this retries.
        """
        assert self._consumer_config is not None
        try:
            await self._js.add_consumer(self._subjects.batch_stream, self._consumer_config)
        except NATS_ERRORS as exc:
            log.warning("consumer not re-created yet: %r", exc, extra=self._log_extra)
            await asyncio.sleep(min(0.5, self._settings.fetch_timeout_s))
        else:
            log.info("consumer %s re-created", self.consumer, extra=self._log_extra)

    async def _fetch_waiting(self, count: int) -> list[Msg]:
        """Take up to `count` micro-batches that are already waiting, without waiting.

        A JetStream no-wait pull: the server sends what it has, then ``404 No
        Messages``; it never lingers on the server for batches not there yet.
        """
        assert self._puller is not None
        try:
            return await self._puller.fetch(count, self._settings.fetch_timeout_s, no_wait=True)
        except (ConsumerGone, *NATS_ERRORS) as exc:
            log.warning("fetching waiting batches failed: %s", exc, extra=self._log_extra)
            return []

    def _plan(self, msgs: list[Msg]) -> list[list[tuple[Msg, MicroBatch | None]]]:
        """Group fetched micro-batches into engine executions.

        Batches with the same tensor signature are joined in arrival order by
        the batch rule the batcher uses (`BatchRule.merge`: the largest
        preferred batch size a prefix adds up to, else up to
        ``max_batch_size`` rows); undecodable ones form groups of their own
        (to be terminated).
        """
        groups: list[list[tuple[Msg, MicroBatch | None]]] = []
        by_signature: dict[tuple, list[tuple[Msg, MicroBatch | None]]] = {}
        for msg in msgs:
            try:
                batch: MicroBatch | None = decode_batch(msg.data)
            except FrameError:
                groups.append([(msg, None)])
                continue
            assert batch is not None
            if self._merge_limit <= 1:
                groups.append([(msg, batch)])
                continue
            by_signature.setdefault(batch_signature(batch.tensors), []).append((msg, batch))
        for waiting in by_signature.values():
            while waiting:
                n = self._batch_rule.merge(b.rows for _, b in waiting if b is not None)
                groups.append(waiting[:n])
                waiting = waiting[n:]
        return groups

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._free += 1
        self._slot_freed.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("batch handler crashed: %r", task.exception(), extra=self._log_extra)

    async def _keepalive(self) -> None:
        """Tell JetStream every third of the ack wait that the batches held here are
        still worked on, so that only a dead (or frozen) worker's batches go elsewhere
        after the short ack wait, never a slow run's."""
        interval = self._settings.ack_wait_s / 3
        while True:
            await asyncio.sleep(interval)
            due = time.monotonic() - interval
            for msg, taken in list(self._held.values()):
                if taken <= due:
                    with contextlib.suppress(*NATS_ERRORS):
                        await msg.in_progress()
