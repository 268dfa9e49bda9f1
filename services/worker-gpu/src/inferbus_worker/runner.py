"""Serving one loaded model version: pull micro-batches, run the engine, reply, ack.

A `ModelRunner` owns the version's engine, a thread pool of
``instance_count`` threads and a pull subscription on the version's durable
consumer. It asks JetStream for one micro-batch per free execution slot and
for none while every slot is busy, so a busy worker leaves work in the queue
for idle ones.

Per micro-batch:

1. garbage that does not decode is terminated (never redelivered);
2. requests whose deadline passed are answered ``DEADLINE_EXCEEDED`` and
   their rows are not computed;
3. the rest run on the engine from zero-copy views of the message;
4. every request gets exactly one reply, and only then is the micro-batch
   acked: replies and ack go out on the same connection in that order (no
   flush round trip between them), so the server sees the ack only after the
   replies; a worker dying before the ack gets the batch redelivered
   (at-least-once inside, the gateway keeps the first answer);
5. inputs the engine rejects are answered ``INVALID_ARGUMENT``, failures
   the engine knows will recur for the same inputs (`PermanentEngineError`:
   a broken model) ``INTERNAL``, both at once and the batch terminated
   (when it holds several requests, each runs alone first,
   `inferbus_worker.isolation`: only the ones that fail alone fail); other
   engine failures are retried with ``nak(delay)`` until the last delivery,
   which is answered ``INTERNAL`` and terminated.

Merging: when a fetched micro-batch says more are waiting for the consumer
(JetStream's ``num_pending``), the runner takes those at once (a no-wait
pull) and joins batches with the same tensor signature up to
``max_batch_size`` rows into one engine execution. Under load the batches
that queued up while the engine was busy thus run as one full batch; when
idle nothing waits (the batcher may dispatch early and the engine still
fills). A merged group is acked, nak'ed or terminated as a whole; if the
engine rejects a merged input, each batch is retried alone so one bad batch
cannot fail its neighbours.

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
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nats.errors
import nats.js.errors
import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry.trace import Link, Span

from inferbus_common import headers as h
from inferbus_common import tracing
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.subjects import Subjects
from inferbus_common.validation import RequestChecker
from inferbus_common.wire import (
    BatchEntry,
    FrameError,
    MicroBatch,
    batch_signature,
    decode_batch,
    join_tensors,
)
from inferbus_worker import metrics
from inferbus_worker.engines import (
    Engine,
    EngineError,
    EngineInputError,
    PermanentEngineError,
    TensorRTEngine,
)
from inferbus_worker.isolation import run_alone
from inferbus_worker.microbatch import (
    BatchReplies,
    LiveRequest,
    Outbox,
    ReplyContext,
    gather_inputs,
    split_expired,
)
from inferbus_worker.processing import Processing
from inferbus_worker.pull import ConsumerGone, PullConsumer
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.stats import VersionCounters

log = logging.getLogger(__name__)

BATCH_SPAN = "inferbus.worker.batch"
REQUEST_SPAN = "inferbus.worker.request"

_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, OSError)
"""Failures talking to NATS: transient, the batch is redelivered."""


_GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider"})


def runs_on_gpu(engine: Engine) -> bool:
    """Whether `engine` computes on a GPU (TensorRT, or ONNX Runtime with a GPU provider)."""
    if isinstance(engine, TensorRTEngine):
        return True
    providers = getattr(engine, "providers", None) or []
    return any(p in _GPU_PROVIDERS for p in providers)


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


class ModelRunner:
    """Pulls and computes the micro-batches of one model version.

    Args:
        nc: connected NATS client (replies are published on it).
        js: its JetStream context.
        subjects: naming scheme.
        settings: worker settings (pool, ack wait, deliveries, fetch timing).
        deployed: the version served.
        engine: its engine, loaded and warmed up; the runner closes it.
        processing: the version's pre/post-processing (None: none); run on
            each engine batch in the engine's thread pool, timed as the
            ``pre`` and ``post`` stages.
    """

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        subjects: Subjects,
        settings: WorkerSettings,
        deployed: DeployedVersion,
        engine: Engine,
        *,
        processing: Processing | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._subjects = subjects
        self._settings = settings
        self.deployed = deployed
        self._config = deployed.config
        # Micro-batches were validated request by request in the batcher, but the
        # work queue is not trusted; layouts that passed are not checked again.
        self._checker = RequestChecker(deployed.config)
        self._engine = engine
        self._slots = deployed.config.instance_count
        self._free = self._slots
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._pool = ThreadPoolExecutor(
            max_workers=self._slots, thread_name_prefix=f"engine-{deployed.model}"
        )
        self._puller: PullConsumer | None = None
        self._consumer_config: ConsumerConfig | None = None
        self._pull_task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._held: dict[int, tuple[Msg, float]] = {}
        """Micro-batches being worked on (id() → message, monotonic time taken)."""
        self._keepalive_task: asyncio.Task[None] | None = None
        self._reply_ctx = ReplyContext(deployed.version, deployed.digest)
        self._outputs = [s.name for s in deployed.config.outputs]
        self._processing = processing
        if processing is not None:
            # The engine is asked for its own outputs; post-processing makes the client's.
            self._outputs = list(processing.engine_outputs)
        self._labels = {"model": deployed.model, "version": deployed.version}
        self.stats = VersionCounters()
        """Cumulative statistics, reported in the heartbeat (Triton's statistics)."""
        self._children: dict[tuple[object, ...], Any] = {}
        self._log_extra = {"model": deployed.model, "version": deployed.version}
        self._idle_subject = subjects.idle(settings.pool, deployed.model, deployed.version)
        self._idle_after_s = settings.idle_signal_after_us / 1e6
        self._inline = InlineRuns(0.0 if runs_on_gpu(engine) else settings.inline_run_max_us / 1e6)
        # Most micro-batches one execution may join (each holds at least one row).
        self._merge_limit = (
            min(settings.max_merge_batches, deployed.config.max_batch_size)
            if deployed.config.max_batch_size > 1
            else 1
        )

    @property
    def consumer(self) -> str:
        """Durable consumer name of this pool/model/version."""
        return self._subjects.batch_consumer(
            self._settings.pool, self.deployed.model, self.deployed.version
        )

    async def start(self) -> None:
        """Create (idempotently) and bind the durable consumer, then start pulling."""
        subject = self._subjects.batch(
            self._settings.pool, self.deployed.model, self.deployed.version
        )
        config = ConsumerConfig(
            durable_name=self.consumer,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self._settings.ack_wait_s,
            backoff=self._settings.consumer_backoff() or None,
            max_deliver=self._settings.max_deliver,
            # Bounds what a pool holds un-acked; each worker asks for no more than its slots.
            max_ack_pending=self._settings.max_ack_pending,
        )
        self._consumer_config = config
        await self._js.add_consumer(self._subjects.batch_stream, config)
        self._puller = PullConsumer(self._nc, self._subjects.batch_stream, self.consumer)
        await self._puller.start()
        self._pull_task = asyncio.create_task(self._pull_loop(), name=f"pull-{self.consumer}")
        self._keepalive_task = asyncio.create_task(
            self._keepalive(), name=f"keepalive-{self.consumer}"
        )
        metrics.EXECUTION_SLOTS.labels(**self._labels).set(self._slots)
        metrics.BUSY_SLOTS.labels(**self._labels).set_function(lambda: self._slots - self._free)

    async def stop(self) -> None:
        """Drain: stop pulling, finish and ack in-flight batches, close the engine."""
        self._stopping.set()
        for gauge in (metrics.EXECUTION_SLOTS, metrics.BUSY_SLOTS):
            with contextlib.suppress(KeyError):
                gauge.remove(self.deployed.model, self.deployed.version)
        self._slot_freed.set()
        if self._pull_task is not None:
            await self._pull_task
            self._pull_task = None
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive_task
            self._keepalive_task = None
        if self._puller is not None:
            with contextlib.suppress(*_NATS_ERRORS):
                await self._puller.stop()
            self._puller = None
        self._pool.shutdown(wait=True)
        await asyncio.to_thread(self._engine.close)

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
            except _NATS_ERRORS as exc:
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
        with contextlib.suppress(*_NATS_ERRORS):
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
        except _NATS_ERRORS as exc:
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
        except (ConsumerGone, *_NATS_ERRORS) as exc:
            log.warning("fetching waiting batches failed: %s", exc, extra=self._log_extra)
            return []

    def _plan(self, msgs: list[Msg]) -> list[list[tuple[Msg, MicroBatch | None]]]:
        """Group fetched micro-batches into engine executions.

        Batches with the same tensor signature are joined in arrival order up
        to `max_batch_size` rows; undecodable ones form groups of their own (to
        be terminated).
        """
        groups: list[list[tuple[Msg, MicroBatch | None]]] = []
        open_groups: dict[tuple, tuple[list[tuple[Msg, MicroBatch | None]], int]] = {}
        for msg in msgs:
            try:
                batch: MicroBatch | None = decode_batch(msg.data)
            except FrameError:
                groups.append([(msg, None)])
                continue
            assert batch is not None
            rows = batch.rows
            if self._merge_limit <= 1:
                groups.append([(msg, batch)])
                continue
            key = batch_signature(batch.tensors)
            current = open_groups.get(key)
            if current is not None and current[1] + rows <= self._config.max_batch_size:
                current[0].append((msg, batch))
                open_groups[key] = (current[0], current[1] + rows)
            else:
                group: list[tuple[Msg, MicroBatch | None]] = [(msg, batch)]
                groups.append(group)
                open_groups[key] = (group, rows)
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
                    with contextlib.suppress(*_NATS_ERRORS):
                        await msg.in_progress()

    async def _handle(self, group: list[tuple[Msg, MicroBatch | None]]) -> None:
        """`_handle_group` (its batches kept alive meanwhile), inside the trace spans
        of the sampled requests it holds."""
        held = self._held
        now = time.monotonic()
        for msg, _ in group:
            held[id(msg)] = (msg, now)
        try:
            await self._handle_spanned(group)
        finally:
            for msg, _ in group:
                held.pop(id(msg), None)

    async def _handle_spanned(self, group: list[tuple[Msg, MicroBatch | None]]) -> None:
        spans = self._start_spans(group) if tracing.enabled() else None
        if not spans:
            await self._handle_group(group)
            return
        try:
            await self._handle_group(group)
        except BaseException as exc:
            for span in spans:
                tracing.end_span(span, "INTERNAL", type(exc).__name__)
            raise
        for span in spans:
            tracing.end_span(span)

    def _start_spans(self, group: list[tuple[Msg, MicroBatch | None]]) -> list[Span]:
        """Spans of one engine execution, when any request in it is sampled.

        One ``inferbus.worker.batch`` span for the execution, a child of the
        first sampled request's batcher span and linked to every sampled
        request's batcher span, and one ``inferbus.worker.request`` span per
        sampled request (a child of that request's batcher span), so every
        sampled request's trace reaches the worker.
        """
        entries = [e for _, b in group if b is not None for e in b.entries]
        sampled = [e for e in entries if tracing.is_sampled(e.traceparent)]
        if not sampled:
            return []
        model, version = self.deployed.model, self.deployed.version
        links = [link for e in sampled if (link := tracing.link_to(e.traceparent)) is not None]
        batch_span = tracing.start_child_span(
            BATCH_SPAN,
            sampled[0].traceparent,
            kind=tracing.SpanKind.INTERNAL,
            links=links,
            attributes={
                "inferbus.model": model,
                "inferbus.version": version,
                "inferbus.batch_requests": len(entries),
                "inferbus.batch_rows": sum(e.rows for e in entries),
                "inferbus.merged_batches": len(group),
            },
        )
        spans = [batch_span] if batch_span is not None else []
        batch_link = [Link(batch_span.get_span_context())] if batch_span is not None else []
        now = h.now_ns()
        for e in sampled:
            span = tracing.start_child_span(
                REQUEST_SPAN,
                e.traceparent,
                links=batch_link,
                attributes={
                    "inferbus.model": model,
                    "inferbus.version": version,
                    "inferbus.request_id": e.request_id,
                    "inferbus.queue_ms": max(0.0, (now - e.enqueued_ns) / 1e6)
                    if e.enqueued_ns
                    else 0.0,
                },
            )
            if span is not None:
                spans.append(span)
        return spans

    async def _handle_group(self, group: list[tuple[Msg, MicroBatch | None]]) -> None:
        msgs = [m for m, _ in group]
        try:
            if group[0][1] is None:
                await self._terminate_garbage(msgs[0])
            elif len(group) == 1:
                await self._process(msgs, group[0][1], split_on_reject=False)
            else:
                batches = [b for _, b in group if b is not None]
                merged = MicroBatch(
                    [e for b in batches for e in b.entries],
                    join_tensors([b.tensors for b in batches]),
                )
                metrics.MERGED.labels(**self._labels).inc(len(group))
                if not await self._process(msgs, merged, split_on_reject=True):
                    # The engine rejected the joined input: find the culprit alone.
                    for msg, batch in group:
                        assert batch is not None
                        await self._process([msg], batch, split_on_reject=False)
        except _NATS_ERRORS as exc:
            # Replies or the ack did not get out; the batch comes back after ack_wait.
            log.warning("lost the bus while answering a batch: %s", exc, extra=self._log_extra)
            metrics.BATCHES.labels(**self._labels, outcome="failed").inc()
        except Exception:  # a bug must not kill the worker; CancelledError is not an Exception
            log.exception("unexpected error handling a batch", extra=self._log_extra)
            metrics.BATCHES.labels(**self._labels, outcome="failed").inc()
            for msg in msgs:
                with contextlib.suppress(*_NATS_ERRORS):
                    await msg.nak(delay=self._settings.nak_delay_s)

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

    async def _process(self, msgs: list[Msg], batch: MicroBatch, *, split_on_reject: bool) -> bool:
        """Run one (possibly merged) micro-batch; False when a merged input was rejected
        and nothing was answered yet (the caller retries the batches alone)."""
        delivered = max(m.metadata.num_delivered for m in msgs)
        redelivered = sum(1 for m in msgs if m.metadata.num_delivered > 1)
        if redelivered:
            metrics.REDELIVERIES.labels(**self._labels).inc(redelivered)
        live_idx, expired_idx = split_expired(batch, h.now_ns())
        if expired_idx:
            await self._fail_all(
                [batch.entries[i] for i in expired_idx],
                StatusCode.DEADLINE_EXCEEDED,
                "deadline passed before the model ran",
            )
        if not live_idx:
            for msg in msgs:
                await msg.ack()
            metrics.BATCHES.labels(**self._labels, outcome="expired").inc(len(msgs))
            return True
        live_entries = [batch.entries[i] for i in live_idx]
        try:
            inputs, requests = gather_inputs(self._config, batch, live_idx, self._checker)
        except InvalidArgument as exc:
            if split_on_reject:
                return False
            await self._poison(msgs, live_entries, StatusCode.INVALID_ARGUMENT, exc.message)
            return True
        stages: dict[str, float] = {}
        if self._processing is not None and self._processing.has_pre:
            inputs, requests = await self._preprocess(inputs, requests, stages)
            if not requests:
                # Every request failed its pre-processing and has been answered.
                for msg in msgs:
                    await msg.ack()
                metrics.BATCHES.labels(**self._labels, outcome="invalid").inc(len(msgs))
                return True
        start_ns = h.now_ns()
        t0 = time.monotonic()
        try:
            outputs = await self._compute(msgs, inputs, sum(r.entry.rows for r in requests))
        except (EngineInputError, PermanentEngineError) as exc:
            if split_on_reject:
                # Expired requests may be answered twice then; the gateway keeps the first.
                return False
            if len(requests) < 2 or self._config.max_batch_size <= 0:
                code = (
                    StatusCode.INVALID_ARGUMENT
                    if isinstance(exc, EngineInputError)
                    else StatusCode.INTERNAL
                )
                await self._poison(msgs, live_entries, code, exc.message)
                return True
            # One request's rows are usually at fault: answer the others as usual.
            outputs, requests = await self._run_alone(inputs, requests)
            if not requests:
                for msg in msgs:
                    await msg.term()
                metrics.BATCHES.labels(**self._labels, outcome="invalid").inc(len(msgs))
                return True
        except EngineError as exc:
            if delivered < self._settings.max_deliver:
                log.warning(
                    "engine failed (delivery %d), retrying later: %s",
                    delivered,
                    exc,
                    extra=self._log_extra,
                )
                for msg in msgs:
                    await msg.nak(delay=self._settings.nak_delay_s)
                metrics.BATCHES.labels(**self._labels, outcome="retried").inc(len(msgs))
                return True
            await self._poison(msgs, live_entries, StatusCode.INTERNAL, "the model failed to run")
            return True
        compute_s = time.monotonic() - t0
        if self._processing is not None and self._processing.has_post:
            outputs = await self._postprocess(outputs, stages)
        rows = sum(r.entry.rows for r in requests)
        self._observe(requests, rows, start_ns, compute_s)
        await self._answer(requests, outputs, rows, start_ns, compute_s, stages=stages)
        self.stats.executed(requests, start_ns, compute_s, stages, time.monotonic() - t0)
        for msg in msgs:
            await msg.ack()
        self._metric(metrics.BATCHES, outcome="ok").inc(len(msgs))
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "batch answered",
                extra={
                    **self._log_extra,
                    "batch_size": rows,
                    "latency_ms": round(compute_s * 1000, 3),
                    "request_id": ",".join(r.entry.request_id for r in requests),
                },
            )
        return True

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
            self._reply_ctx,
            outputs,
            batched=self._config.max_batch_size > 0,
            compute_ms=compute_s * 1000,
            batch_rows=rows,
            stages_ms=stages,
        )
        outbox = Outbox(self._reply_ctx, replies.shared_timings, rows)
        for r in requests:
            entry = r.entry
            queue_ms = max(0.0, (start_ns - entry.enqueued_ns) / 1e6) if entry.enqueued_ns else 0.0
            try:
                if entry.token:
                    outbox.ok(entry, queue_ms, replies.frame_parts(r))
                else:
                    headers, body = replies.ok(r, queue_ms)
                    outbox.single(entry, headers, body, "OK")
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
