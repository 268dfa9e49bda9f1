"""The batcher service: NATS intake, one queue per model version, JetStream output.

Request bundles arrive on ``<prefix>.infer.<model>.<version>`` (queue group, so
several batchers share the load); nothing else is taken there (a message in
any other framing gets INVALID_ARGUMENT when it names a reply subject). Each
request is checked (deployed version, deadline, structure),
put in its version's `ModelQueue`, and batches that are due are joined along
the batch axis and published to the ``IB_BATCHES`` work queue. Every request
gets exactly one answer from the batcher when it is refused, expires or its
batch cannot be stored; otherwise the worker answers it. The checks and queue
entries are in `inferbus_batcher.intake`, queues and batch forming in
`inferbus_batcher.batching`, the stream and its stores in `inferbus_batcher.workqueue`.

Concurrency model: everything runs on one event loop. The subscription callback
does the intake and dispatches batches that became due on arrival; a per-queue
`loop.call_later` timer (monotonic clock) marks a queue due when its oldest
request has waited ``max_queue_delay_us`` or a deadline passes, and one pump
task services due queues. Publishes run as owned tasks, at most
``max_outstanding_publishes`` at a time; when they are all busy, ready batches
stay queued, so a slow JetStream backs up into ``queue-full`` answers instead of
unbounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from inferbus_batcher.batching import FormedBatch, ModelQueue, PendingRequest
from inferbus_batcher.intake import admit
from inferbus_batcher.metrics import (
    IDLE_DISPATCHES,
    PUBLISHES_OUTSTANDING,
    REJECTIONS,
    QueueMetrics,
)
from inferbus_batcher.settings import BatcherSettings
from inferbus_batcher.workqueue import PublishFailed, WorkQueue
from inferbus_common import tracing
from inferbus_common.bus import connect, leave, sync
from inferbus_common.catalog import Catalog
from inferbus_common.errors import (
    InferbusError,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StatusCode,
)
from inferbus_common.lifecycle import default_instance_id
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import BundledRequest, decode_request_bundle
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.microbatch import encode_joined_batch
from inferbus_common.protocol.replies import ReplyTarget, send_error, send_errors
from inferbus_common.subjects import Subjects, name_from_token
from inferbus_common.validation import RequestChecker

log = logging.getLogger(__name__)

# Idle signals a queue keeps, and how long one stays valid (a worker re-announces
# after every empty long poll, about once a second).
_MAX_IDLE_CREDITS = 8
_IDLE_CREDIT_S = 2.0
# The idle fast path is for sparse traffic only: when the queue dispatched less
# than this many queue delays ago (at least _SPARSE_MIN_S), requests arrive fast
# enough that waiting fills batches, which costs less per request than sending
# each alone.
_SPARSE_FACTOR = 4
_SPARSE_MIN_S = 0.002


@dataclass(slots=True, eq=False)
class _QueueState:
    """A model version's queue plus what the service keeps next to it."""

    queue: ModelQueue
    subject: str
    metrics: QueueMetrics
    checker: RequestChecker
    """Validates requests against the queue's current config."""
    timer: asyncio.TimerHandle | None = None
    timer_at: int | None = None
    idle_credits: int = 0
    """Idle signals from workers not yet used: dispatch at once instead of waiting."""
    idle_until: float = 0.0
    """Monotonic time after which the credits are stale."""
    last_dispatch: float = 0.0
    """Monotonic time of the queue's last dispatch."""


class Batcher:
    """The batcher: an async context manager that serves until it is left.

    Leaving the context drains: the subscription stops taking requests, what
    waits is flushed as final batches, outstanding publishes are awaited (up
    to ``drain_timeout_s``), then the connection closes.

    Args:
        settings: the process settings (built once in `main`).
    """

    def __init__(self, settings: BatcherSettings) -> None:
        self._settings = settings
        self._subjects = Subjects(settings.subject_prefix)
        self.instance_id = settings.instance_id or default_instance_id("batcher")
        # A restart can reuse host and pid (pid 1 in containers); the nonce keeps
        # Nats-Msg-Id unique inside JetStream's duplicate window across restarts.
        self._msg_id_prefix = f"{self.instance_id}-{uuid.uuid4().hex[:12]}-"
        self._seq = 0
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._catalog: Catalog | None = None
        self._catalog_loaded = False
        self._work_queue: WorkQueue | None = None
        self._sub: Subscription | None = None
        self._idle_sub: Subscription | None = None
        self._queues: dict[tuple[str, str], _QueueState] = {}
        self._due: set[_QueueState] = set()
        self._blocked: set[_QueueState] = set()
        self._wake = asyncio.Event()
        self._publishes: set[asyncio.Task[None]] = set()
        self._pump_task: asyncio.Task[None] | None = None
        self._draining = False
        self._flushing = False
        self._closed = False

    # --- lifecycle -----------------------------------------------------------
    async def __aenter__(self) -> Batcher:
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.drain()
        finally:
            await self._close()

    async def _start(self) -> None:
        s = self._settings
        self._nc = await connect(s.nats_url, self.instance_id, **s.nats_auth())
        self._js = self._nc.jetstream()
        work_queue = WorkQueue(self._js, self._subjects, s)
        await work_queue.ensure()
        self._work_queue = work_queue
        self._catalog = Catalog(self._js, self._subjects)
        await self._catalog.__aenter__()
        await self._catalog.wait_loaded()
        self._catalog_loaded = True
        self._pump_task = asyncio.create_task(self._pump(), name="batcher-pump")
        self._sub = await self._nc.subscribe(
            self._subjects.infer_all,
            queue=s.queue_group,
            cb=self._on_request,
            pending_msgs_limit=s.pending_msgs_limit,
            pending_bytes_limit=s.pending_bytes_limit,
        )
        self._idle_sub = await self._nc.subscribe(self._subjects.idle_all, cb=self._on_idle)
        await sync(self._nc)  # subscribed at nats-server before "serving"
        log.info("batcher %s serving", self.instance_id, extra={"nats_url": s.nats_url})

    def ready(self) -> tuple[bool, str]:
        """Readiness for /readyz: NATS connected, catalog loaded, stream present."""
        if self._nc is None or not self._nc.is_connected:
            return False, "not connected to NATS"
        if self._work_queue is None:
            return False, "micro-batch stream not ensured yet"
        if not self._catalog_loaded:
            return False, "catalog not loaded yet"
        if self._sub is None and not self._draining:
            return False, "not subscribed to requests yet"
        if self._draining:
            return False, "draining"
        return True, "ok"

    async def drain(self) -> None:
        """Stop intake, flush queued requests as final batches, await their publishes.

        Idempotent. Requests still unanswered after ``drain_timeout_s`` are
        answered UNAVAILABLE.
        """
        if self._draining or self._nc is None:
            return
        self._draining = True
        try:
            async with asyncio.timeout(self._settings.drain_timeout_s):
                if self._sub is not None:
                    # Unsubscribes, then waits until the requests already
                    # routed to us have been taken in.
                    with contextlib.suppress(nats.errors.Error):
                        await leave(self._sub)
                self._flushing = True
                while True:
                    for state in list(self._queues.values()):
                        await self._service(state)
                    if self._publishes:
                        await asyncio.wait(set(self._publishes))
                    elif not any(st.queue.depth for st in self._queues.values()):
                        break
        except TimeoutError:
            log.warning("drain timed out; answering what is left UNAVAILABLE")
            for state in list(self._queues.values()):
                left = state.queue.drain_all()
                state.metrics.set_depth(0)
                await self._answer_many(
                    state,
                    left,
                    StatusCode.UNAVAILABLE,
                    "batcher shut down before dispatch",
                    "shutdown",
                )
            await self._cancel_publishes()

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
        await self._cancel_publishes()
        for state in self._queues.values():
            if state.timer is not None:
                state.timer.cancel()
        if self._catalog is not None:
            await self._catalog.__aexit__(None, None, None)
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.flush(timeout=2)
            await self._nc.close()

    async def _cancel_publishes(self) -> None:
        tasks = list(self._publishes)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- intake --------------------------------------------------------------
    async def _on_request(self, msg: Msg) -> None:
        """Take in a request bundle: every request is queued or refused (one reply
        bundle per distinct refusal). Checks are structural (`intake.admit`,
        docs/security.md); the bundle must be for the version its subject names."""
        try:
            bundle = decode_request_bundle(msg.data)
        except FrameError as exc:
            await self._refuse_unframed(msg, exc)
            return
        refused: list[tuple[BundledRequest, InferbusError]] = []
        state: _QueueState | None = None
        try:
            model, version = self._names_from_subject(msg.subject)
            if bundle.model != model or (bundle.version and bundle.version != version):
                raise InvalidArgument(
                    f"a request bundle for model '{bundle.model}' version "
                    f"'{bundle.version}' arrived on {msg.subject}"
                )
            bundle.version = version
            state = self._queue_of(model, version)
        except InferbusError as exc:
            refused = [(r, exc) for r in bundle.requests]
        if state is not None:
            queue = state.queue
            now_wall = time.time_ns()
            now_mono = time.monotonic_ns()
            for r in bundle.requests:
                pending = None
                try:
                    pending = admit(queue, state.checker, r, bundle.inbox, now_wall, now_mono)
                    queue.offer(pending)
                except InferbusError as exc:
                    if pending is not None and pending.span is not None:
                        tracing.end_span(pending.span, exc.code.name, exc.message)
                    refused.append((r, exc))
                except Exception:
                    # A bug must still get the request one answer, without leaking details.
                    log.exception(
                        "failed to accept a request", extra={"request_id": r.envelope.request_id}
                    )
                    refused.append((r, Internal("batcher failed to accept the request")))
        if refused:
            await self._refuse_bundled(state, bundle.model, bundle.version, bundle.inbox, refused)
        if state is not None:
            await self._service(state)

    async def _refuse_unframed(self, msg: Msg, exc: FrameError) -> None:
        """A message that is not a request bundle: INVALID_ARGUMENT to the reply
        subject it names (nothing is queued for it), else counted and dropped."""
        REJECTIONS.labels("-", "-", "garbage").inc()
        hdrs = msg.headers or {}
        reply = hdrs.get(h.REPLY) or msg.reply or ""
        if not reply:
            log.warning("dropped a message that is not a request bundle: %s", exc)
            return
        assert self._nc is not None
        with contextlib.suppress(nats.errors.Error):
            await send_error(
                self._nc,
                reply,
                InvalidArgument(
                    f"{msg.subject} takes request bundles (IBQ1) only; this message is "
                    f"not one ({exc.message}); nothing was queued"
                ),
                hdrs.get(h.REQUEST_ID, ""),
            )

    async def _on_idle(self, msg: Msg) -> None:
        """A worker has a free slot and found its queue empty: stop waiting for fills.

        Waiting out ``max_queue_delay_us`` only pays when the engine is busy;
        with an idle worker the next request (and whatever waits now) is
        dispatched at once. Credits are few and short-lived, so under load,
        when workers are never idle, batching is unchanged.
        """
        parts = msg.subject.rsplit(".", 2)
        try:
            key = (name_from_token(parts[-2]), name_from_token(parts[-1]))
        except (ValueError, IndexError, UnicodeDecodeError):
            return
        state = self._queues.get(key)
        if state is None:
            return
        state.idle_credits = min(state.idle_credits + 1, _MAX_IDLE_CREDITS)
        state.idle_until = time.monotonic() + _IDLE_CREDIT_S
        if state.queue.depth:
            self._due.add(state)
            self._wake.set()

    @staticmethod
    def _names_from_subject(subject: str) -> tuple[str, str]:
        """The model and version a subject ``<prefix>.infer.<model>.<version>`` names."""
        parts = subject.rsplit(".", 2)
        try:
            return name_from_token(parts[-2]), name_from_token(parts[-1])
        except (ValueError, IndexError, UnicodeDecodeError):
            raise InvalidArgument(f"subject {subject!r} does not name a model version") from None

    def _queue_of(self, model: str, version: str) -> _QueueState:
        """The queue of a deployed version (created on first use).

        Raises:
            NotFound: the version is not deployed.
        """
        assert self._catalog is not None
        deployed = self._catalog.versions.get((model, version))
        if deployed is None:
            raise NotFound(f"model '{model}' version '{version}' is not deployed")
        config = deployed.config
        state = self._queues.get((model, version))
        if state is None:
            state = self._new_queue(model, version, deployed.config)
        elif state.queue.config is not config:
            # The registry re-published the version: new batching knobs or pool.
            state.queue.configure(config)
            state.checker = RequestChecker(config)
            state.subject = self._subjects.batch(config.pool, model, version)
        return state

    async def _refuse_bundled(
        self,
        state: _QueueState | None,
        model: str,
        version: str,
        inbox: str,
        refused: list[tuple[BundledRequest, InferbusError]],
    ) -> None:
        """Answer refused requests of one bundle (one reply bundle per distinct error)."""
        by_error: dict[tuple[StatusCode, str, str], list[ReplyTarget]] = {}
        for r, exc in refused:
            reason = exc.reason if isinstance(exc, ResourceExhausted) else ""
            label = reason or exc.code.name.lower()
            if state is not None:
                state.metrics.rejected(label)
            else:
                REJECTIONS.labels(model or "-", version or "-", label).inc()
            by_error.setdefault((exc.code, exc.message, reason), []).append(
                ReplyTarget(inbox, r.token, r.envelope.request_id)
            )
        for (code, message, reason), targets in by_error.items():
            await self._send_errors(targets, code, message, reason, version)

    async def _send_errors(
        self,
        targets: list[ReplyTarget],
        code: StatusCode,
        message: str,
        reason: str,
        version: str,
    ) -> None:
        assert self._nc is not None
        try:
            await send_errors(self._nc, targets, code, message, reason=reason, version=version)
        except nats.errors.Error as exc:
            log.warning(
                "could not send an error answer: %s",
                type(exc).__name__,
                extra={"status": code.name, "model_version": version},
            )

    def _new_queue(self, model: str, version: str, config: ModelConfig) -> _QueueState:
        state = _QueueState(
            queue=ModelQueue(model, version, config),
            subject=self._subjects.batch(config.pool, model, version),
            metrics=QueueMetrics(model, version),
            checker=RequestChecker(config),
        )
        self._queues[(model, version)] = state
        return state

    # --- dispatch ------------------------------------------------------------
    async def _service(self, state: _QueueState) -> None:
        """Take what is due from one queue, launch its publishes, answer expiries."""
        queue = state.queue
        now_mono = time.monotonic_ns()
        room = self._settings.max_outstanding_publishes - len(self._publishes)
        now_idle = False
        if state.idle_credits and queue.depth:
            now_s = time.monotonic()
            if now_s > state.idle_until:
                state.idle_credits = 0
            elif now_s - state.last_dispatch >= max(
                _SPARSE_FACTOR * queue.delay_ns / 1e9, _SPARSE_MIN_S
            ):
                # Sparse traffic and an idle worker: waiting would only add latency.
                now_idle = True
                state.idle_credits -= 1
                IDLE_DISPATCHES.inc()
        out = queue.take_ready(
            now_mono, time.time_ns(), limit=room, flush=self._flushing or now_idle
        )
        if out.batches:
            state.last_dispatch = time.monotonic()
        for batch in out.batches:
            self._launch(state, batch, now_mono)
        if out.limited:
            self._blocked.add(state)
        self._arm(state)
        state.metrics.set_depth(queue.depth)
        if out.expired:
            await self._answer_many(
                state,
                out.expired,
                StatusCode.DEADLINE_EXCEEDED,
                f"deadline passed while queued for model '{queue.model}' version '{queue.version}'",
                "deadline_exceeded",
            )

    def _arm(self, state: _QueueState) -> None:
        wake = state.queue.wake_mono_ns
        if wake is None:
            if state.timer is not None:
                state.timer.cancel()
                state.timer = state.timer_at = None
            return
        if state.timer is not None and state.timer_at is not None and state.timer_at <= wake:
            # An earlier (or equal) timer is set; when it fires the queue is re-armed.
            return
        if state.timer is not None:
            state.timer.cancel()
        delay_s = max(0.0, (wake - time.monotonic_ns()) / 1e9)
        state.timer = asyncio.get_running_loop().call_later(delay_s, self._on_timer, state)
        state.timer_at = wake

    def _on_timer(self, state: _QueueState) -> None:
        state.timer = state.timer_at = None
        self._due.add(state)
        self._wake.set()

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            due, self._due = self._due, set()
            for state in due:
                try:
                    await self._service(state)
                except Exception:
                    # A bug in one queue must not stop the timers of all others.
                    log.exception(
                        "servicing a queue failed",
                        extra={"model": state.queue.model, "version": state.queue.version},
                    )

    def _launch(self, state: _QueueState, batch: FormedBatch, now_mono: int) -> None:
        requests = batch.requests
        m = state.metrics
        for p in requests:
            m.queue_time.observe((now_mono - p.enqueued_mono_ns) / 1e9)
        payload = encode_joined_batch([p.entry() for p in requests], [p.tensors for p in requests])
        assert self._nc is not None
        if len(payload) > self._nc.max_payload and len(requests) > 1:
            # The joined batch is over the bus's message size limit: send it as
            # two smaller batches (each request's rows stay whole).
            half = len(requests) // 2
            for part in (requests[:half], requests[half:]):
                self._launch(state, FormedBatch(part, sum(p.rows for p in part)), now_mono)
            return
        self._seq += 1
        task = asyncio.create_task(
            self._publish(state, batch, payload, f"{self._msg_id_prefix}{self._seq}")
        )
        self._publishes.add(task)
        PUBLISHES_OUTSTANDING.set(len(self._publishes))
        task.add_done_callback(self._publish_done)

    def _publish_done(self, task: asyncio.Task[None]) -> None:
        self._publishes.discard(task)
        PUBLISHES_OUTSTANDING.set(len(self._publishes))
        if not task.cancelled() and task.exception() is not None:
            log.error("micro-batch publish task failed", exc_info=task.exception())
        if self._blocked:
            self._due |= self._blocked
            self._blocked = set()
            self._wake.set()

    async def _publish(
        self, state: _QueueState, batch: FormedBatch, payload: bytes, msg_id: str
    ) -> None:
        queue = state.queue
        try:
            assert self._work_queue is not None
            await self._work_queue.store(state.subject, queue.model, queue.version, payload, msg_id)
        except asyncio.CancelledError:
            await self._answer_many(
                state,
                batch.requests,
                StatusCode.UNAVAILABLE,
                "batcher shut down before the micro-batch was stored",
                "shutdown",
            )
            raise
        except PublishFailed as exc:
            log.warning(
                "micro-batch not stored: %s",
                exc.message,
                extra={"model": queue.model, "version": queue.version, "reason": exc.reason},
            )
            await self._answer_many(state, batch.requests, exc.code, exc.message, exc.reason)
            return
        except Exception:
            # A bug: the requests still get their one answer, without internals.
            log.exception(
                "micro-batch publish failed", extra={"model": queue.model, "version": queue.version}
            )
            await self._answer_many(
                state, batch.requests, StatusCode.INTERNAL, "batcher failed to publish", "internal"
            )
            return
        state.metrics.published.inc()
        if tracing.enabled():
            for p in batch.requests:
                if p.span is not None:
                    p.span.set_attribute("inferbus.batch_requests", len(batch.requests))
                    p.span.set_attribute("inferbus.batch_rows", batch.rows)
                    tracing.end_span(p.span)
                    p.span = None
        state.metrics.batch_rows.observe(batch.rows)
        state.metrics.batch_requests.observe(len(batch.requests))

    # --- answers -------------------------------------------------------------
    async def _answer_many(
        self,
        state: _QueueState,
        requests: list[PendingRequest],
        code: StatusCode,
        message: str,
        reason: str,
    ) -> None:
        if not requests:
            return
        state.metrics.rejected(reason, len(requests))
        if tracing.enabled():
            for p in requests:
                if p.span is not None:
                    tracing.end_span(p.span, code.name, message)
                    p.span = None
        await self._send_errors(
            [ReplyTarget(p.reply, p.token, p.request_id) for p in requests],
            code,
            message,
            reason,
            state.queue.version,
        )
