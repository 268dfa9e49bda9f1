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

The pull loop and the grouping of fetched batches are in
`inferbus_worker.pullloop`, engine runs (inline or in the pool) and
pre/post-processing in `inferbus_worker.execution`, replies in
`inferbus_worker.answering`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry.trace import Link, Span

from inferbus_common import tracing
from inferbus_common.batchrule import BatchRule
from inferbus_common.bus import leave
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import MicroBatch
from inferbus_common.protocol.tensors import join_tensors
from inferbus_common.subjects import Subjects
from inferbus_common.validation import RequestChecker
from inferbus_worker import metrics
from inferbus_worker.answering import Answering
from inferbus_worker.engines import Engine, EngineError, EngineInputError, PermanentEngineError
from inferbus_worker.execution import EngineExecution, InlineRuns, runs_on_gpu
from inferbus_worker.fastlane import FastLane
from inferbus_worker.microbatch import ReplyContext, gather_inputs, split_expired
from inferbus_worker.processing import Processing
from inferbus_worker.pull import PullConsumer
from inferbus_worker.pullloop import NATS_ERRORS, PullLoop
from inferbus_worker.scripthooks import ScriptExecution, batch_deadline
from inferbus_worker.scriptpool import ScriptProcessing
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.stats import VersionCounters

log = logging.getLogger(__name__)

BATCH_SPAN = "inferbus.worker.batch"
REQUEST_SPAN = "inferbus.worker.request"
FAST_LANE_LEAVE_S = 2.0
"""How long a stopping worker waits to leave the fast lane's queue group."""


class ModelRunner(PullLoop, FastLane, EngineExecution, ScriptExecution, Answering):
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
        script: the version's ``preprocessor.py`` (None: none), started; run
            around the engine in its sandboxed processes
            (`inferbus_worker.scripthooks`); the runner closes it.
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
        script: ScriptProcessing | None = None,
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
        self._fast_sub: Subscription | None = None
        self._reply_ctx = ReplyContext(deployed.version, deployed.digest)
        self._batch_rule = BatchRule.of(deployed.config)
        self._outputs = [s.name for s in deployed.config.outputs]
        self._processing = processing
        if processing is not None:
            # The engine is asked for its own outputs; post-processing makes the client's.
            self._outputs = list(processing.engine_outputs)
        self._script = script
        self._script_timeout_s = settings.script_timeout_s
        self._script_margin_s = settings.script_reply_margin_ms / 1000
        if script is not None and script.has_post:
            self._outputs = list(script.engine_outputs)
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
        if self._settings.fast_lane:
            self._fast_sub = await self._nc.subscribe(
                self._subjects.fast(self.deployed.model, self.deployed.version),
                queue="workers",
                cb=self._on_fast,
            )
        self._keepalive_task = asyncio.create_task(
            self._keepalive(), name=f"keepalive-{self.consumer}"
        )
        metrics.EXECUTION_SLOTS.labels(**self._labels).set(self._slots)
        metrics.BUSY_SLOTS.labels(**self._labels).set_function(lambda: self._slots - self._free)

    async def stop(self) -> None:
        """Drain: stop pulling, finish and ack in-flight batches, close the engine."""
        self._stopping.set()
        if self._fast_sub is not None:
            # What nats-server routed here before it saw the leave is answered
            # `busy` (stopping): the gateway sends it the normal way at once.
            with contextlib.suppress(*NATS_ERRORS, TimeoutError):
                await asyncio.wait_for(leave(self._fast_sub), FAST_LANE_LEAVE_S)
            self._fast_sub = None
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
            with contextlib.suppress(*NATS_ERRORS):
                await self._puller.stop()
            self._puller = None
        self._pool.shutdown(wait=True)
        if self._script is not None:
            await self._script.close()
        await asyncio.to_thread(self._engine.close)

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
        except NATS_ERRORS as exc:
            # Replies or the ack did not get out; the batch comes back after ack_wait.
            log.warning("lost the bus while answering a batch: %s", exc, extra=self._log_extra)
            metrics.BATCHES.labels(**self._labels, outcome="failed").inc()
        except Exception:  # a bug must not kill the worker; CancelledError is not an Exception
            log.exception("unexpected error handling a batch", extra=self._log_extra)
            metrics.BATCHES.labels(**self._labels, outcome="failed").inc()
            for msg in msgs:
                with contextlib.suppress(*NATS_ERRORS):
                    await msg.nak(delay=self._settings.nak_delay_s)

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
        deadline = 0.0
        if self._script is not None:
            deadline = batch_deadline(requests, self._script_timeout_s, self._script_margin_s)
        if self._script is not None and self._script.has_pre:
            scripted = await self._script_stage("pre", msgs, inputs, requests, stages, deadline)
            if scripted is None:
                return True  # answered INTERNAL, terminated
            inputs = scripted
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
        if self._script is not None and self._script.has_post:
            scripted = await self._script_stage("post", msgs, outputs, requests, stages, deadline)
            if scripted is None:
                return True
            outputs = scripted
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
