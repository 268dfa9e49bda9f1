"""`VersionServer`: serves one loaded generative version over NATS.

Bounded intake through the ``llm`` queue group (leave it when full, hand on
what still arrives), one streamed chunk per engine step, cancellation, and
in-place recovery of a dead vLLM engine. See docs/architecture.md ("The
generative path", 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common.bus import HEADER_ROOM, body_limit, sync
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InferbusError,
    ResourceExhausted,
    Unavailable,
    status_of,
)
from inferbus_common.generation import (
    LLM_FULL_REASON,
    LLM_LATE_REASON,
    GenerationChunk,
    GenerationRequest,
    pack_chunk,
)
from inferbus_common.modelconfig import GenerationConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_headers
from inferbus_common.subjects import Subjects
from inferbus_worker.heartbeat import NATS_ERRORS
from inferbus_worker.llm import metrics
from inferbus_worker.llm.capacity import Capacity
from inferbus_worker.llm.engine import (
    EngineDead,
    LlmEngine,
)
from inferbus_worker.llm.intake import QueueIntake
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.supervision import EngineSupervision

log = logging.getLogger(__name__)

NATS_ERRORS = NATS_ERRORS


class VersionServer(QueueIntake, EngineSupervision):
    """Serves one loaded version: admission, streaming, cancellation, engine recovery.

    Args:
        nc: NATS connection.
        subjects: naming scheme.
        dv: the deployed version.
        engine: its started engine.
        settings: restart attempts, waits and shutdown limit.
        on_state: called with the version's new state (``restarting: …``,
            ``ready``, ``failed: …``) when the engine dies and recovers.
        on_fatal: called with the reason once restarts failed
            ``engine_restart_attempts`` times in a row.
        worker_id: the worker's id; the router places requests by prompt prefix on
            ``ib.gen.<model>.<version>.<worker_id>`` ('' : no placement subject).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        dv: DeployedVersion,
        engine: LlmEngine,
        settings: LlmWorkerSettings,
        on_state: Callable[[str], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        worker_id: str = "",
    ) -> None:
        self._nc = nc
        self.worker_id = worker_id
        """This worker's id: the last token of its placement subject ('' : none)."""
        self._subjects = subjects
        self.dv = dv
        self.engine = engine
        self._settings = settings
        self._on_state = on_state or (lambda _state: None)
        self._on_fatal = on_fatal or (lambda _reason: None)
        self.down = ""
        """Why the engine is not serving ('' while it serves); new requests get it."""
        self._recovery: asyncio.Task[None] | None = None
        gen = dv.config.generation or GenerationConfig()
        self.bound = gen.max_num_seqs + gen.max_waiting
        self.direct_bound = gen.max_num_seqs
        self.capacity = Capacity(gen.max_num_seqs)
        """Recent requests' timings: the estimate behind deadline admission."""
        self._deadline_admission = gen.deadline_admission
        self._default_max_tokens = gen.default_max_tokens
        self._timeout_s = gen.default_timeout_ms / 1000.0
        self._labels = (dv.model, dv.version)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborted: set[str] = set()
        """Requests `cancel` aborted whose tasks have not ended yet."""
        self._ids = itertools.count(1)
        self._sub: Subscription | None = None
        """The intake subscription while the server has room (None while full)."""
        self._direct_sub: Subscription | None = None
        """The placement subscription while a running slot is free."""
        self._opening = False
        self._direct_opening = False
        self._intake_tasks: set[asyncio.Task[None]] = set()
        """Joins of the queue group and drains of left subscriptions under way."""
        self._handoff_inbox = ""
        """Where "no responders" for requests we handed off comes back."""
        self._handoff_sub: Subscription | None = None
        self._stopping = False
        self._frames: dict[str, list[tuple[str, bytes]]] = {}
        """Chunk frames being filled: frames subject → (request id, packed chunk)
        (`_publish`)."""
        self._frame_flush: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        """Requests held (running + waiting in the engine)."""
        return len(self._tasks)

    async def start(self) -> None:
        """Subscribe to the version's generation subject (queue group ``llm``)."""
        self._handoff_inbox = self._nc.new_inbox()
        self._handoff_sub = await self._nc.subscribe(
            f"{self._handoff_inbox}.>", cb=self._on_handoff_refused
        )
        await self._open_intake()

    async def stop(self, timeout_s: float) -> None:
        """Stop intake, let in-flight requests finish for `timeout_s`, abort the rest.

        Aborted requests get a final UNAVAILABLE chunk, so their clients learn at
        once (and may retry elsewhere) instead of waiting for their deadline. A
        recovery under way is cancelled (an engine it is starting in a thread is
        left to the process's exit, as for a cancelled load).
        """
        self._stopping = True
        if self._recovery is not None:
            self._recovery.cancel()
            await asyncio.gather(self._recovery, return_exceptions=True)
            self._recovery = None
        self._close_intake()
        if self._intake_tasks:
            await asyncio.wait(list(self._intake_tasks), timeout=timeout_s)
        if self._handoff_sub is not None:
            # Round trips: "no responders" for what we handed off is in by now.
            with contextlib.suppress(*NATS_ERRORS, TimeoutError):
                await sync(self._nc, timeout=2)
                await asyncio.sleep(0.05)
                await self._handoff_sub.unsubscribe()
            self._handoff_sub = None
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._flush_frames()
        await self._shutdown(self.engine)
        self._zero_gauges()

    def cancel(self, request_id: str, why: str) -> bool:
        """Abort a request this server holds (its task's cancellation aborts the engine).

        Once per request: False for one already aborted (its task still winding down).
        """
        task = self._tasks.get(request_id)
        if task is None or task.done() or request_id in self._aborted:
            return False
        self._aborted.add(request_id)
        metrics.ABORTED.labels(*self._labels, why).inc()
        task.cancel()
        return True

    async def _publish(
        self,
        reply: str,
        seq: int,
        body: bytes,
        extra: dict[str, str],
        final: bool,
        rid: str,
        frames: str = "",
    ) -> None:
        """Send one chunk: into the pending frame for `frames` (a plain chunk of a
        gateway that takes frames), else as a message of its own after the frames."""
        limit = body_limit(self._nc)
        if frames and not extra:
            entry = pack_chunk(reply, seq, final, body)
            if len(entry) <= limit:
                pending = self._frames.get(frames)
                if pending is None:
                    pending = self._frames[frames] = []
                pending.append((rid, entry))
                if self._frame_flush is None:
                    # Runs after the other streams this engine step woke have added theirs.
                    self._frame_flush = asyncio.create_task(self._flush_frames())
                return
        if len(body) > limit:
            # The stream's task answers this error in a message that fits.
            raise ResourceExhausted(
                f"a generated chunk of {len(body)} bytes is larger than a message on the "
                f"platform's bus may be (nats-server max_payload {self._nc.max_payload} "
                f"bytes, less {HEADER_ROOM} for headers); ask for fewer logprobs or "
                "raise max_payload"
            )
        await self._flush_frames()  # what a stream sent before goes first
        headers = {h.SEQ: str(seq), h.REQUEST_ID: rid, h.VERSION: self.dv.version, **extra}
        if final:
            headers[h.FINAL] = "1"
        metrics.CHUNK_MESSAGES.labels(*self._labels, "single").inc()
        await self._nc.publish(reply, body, headers=headers)

    async def _flush_frames(self) -> None:
        """Publish every pending chunk frame: one message per gateway, more where one
        would pass the bus's ``max_payload``.

        A frame the bus refuses (connection closed, reconnect buffer full) loses a
        chunk of each of its streams: they are aborted (``why="publish"``) instead
        of generating on for a gateway that can only fail them on the gap.
        """
        self._frame_flush = None
        if not self._frames:
            return
        frames, self._frames = self._frames, {}
        headers = {h.VERSION: self.dv.version}
        limit = body_limit(self._nc)
        for subject, entries in frames.items():
            for rids, frame in _split_frames(entries, limit):
                metrics.CHUNK_MESSAGES.labels(*self._labels, "frame").inc()
                metrics.FRAMED_CHUNKS.labels(*self._labels).inc(len(rids))
                try:
                    await self._nc.publish(subject, frame, headers=headers)
                except NATS_ERRORS as exc:
                    log.warning(
                        "a chunk frame of %d streams to %s could not be sent (%s); aborting them",
                        len(rids),
                        subject,
                        exc or type(exc).__name__,
                    )
                    for rid in rids:
                        self.cancel(rid, "publish")

    async def _on_request(self, msg: Msg) -> None:
        headers = msg.headers or {}
        reply = headers.get(h.REPLY) or msg.reply
        rid = headers.get(h.REQUEST_ID) or f"gen-{os.getpid()}-{next(self._ids)}"
        if not reply:
            log.warning("generation request %s without a reply subject dropped", rid)
            return
        try:
            if rid in self._tasks:
                raise FailedPrecondition(f"request id {rid!r} is already being generated")
            if self.down:
                raise EngineDead(
                    f"model '{self.dv.model}' version '{self.dv.version}': {self.down}"
                )
            if self._stopping or self.in_flight >= self.bound:
                if await self._hand_off(msg, headers):
                    return
            if self._stopping:
                raise Unavailable(
                    f"the worker serving model '{self.dv.model}' version '{self.dv.version}' "
                    "is stopping; nothing was generated, retry"
                )
            if self.in_flight >= self.bound:
                metrics.REJECTED.labels(*self._labels).inc()
                raise ResourceExhausted(
                    f"model '{self.dv.model}' version '{self.dv.version}': {self.in_flight} "
                    f"requests already run or wait on this worker (bound {self.bound}); "
                    "retry later",
                    reason=LLM_FULL_REASON,
                    retry_after_s=1.0,
                )
            request = GenerationRequest.decode(msg.data)
            deadline_ns = int(headers.get(h.DEADLINE) or 0) or h.deadline_from_timeout(
                self._timeout_s
            )
            self._admit_in_time(request, deadline_ns)
        except InferbusError as exc:
            metrics.REQUESTS.labels(*self._labels, exc.code.name).inc()
            with contextlib.suppress(*NATS_ERRORS):
                await self._publish(reply, 0, b"", error_headers(exc, rid), True, rid)
            return
        frames = headers.get(h.CHUNK_FRAMES, "")
        task = asyncio.create_task(
            self._run(rid, request, reply, deadline_ns, frames), name=f"gen-{rid}"
        )
        self._tasks[rid] = task
        metrics.IN_FLIGHT.labels(*self._labels).set(len(self._tasks))
        task.add_done_callback(lambda _t: self._forget(rid, task))
        self._intake_changed()

    def _admit_in_time(self, request: GenerationRequest, deadline_ns: int) -> None:
        """Refuse a request that would wait here and, by the recent requests, not
        finish before its deadline (`inferbus_worker.llm.capacity`).

        Raises:
            ResourceExhausted: ``llm-late``, with a Retry-After of the estimated wait.
        """
        max_tokens = request.max_tokens or self._default_max_tokens
        est = self.capacity.estimate(self.in_flight, max_tokens)
        metrics.ESTIMATED_WAIT.labels(*self._labels).set(est.wait_s)
        if not self._deadline_admission or not self.capacity.known or not est.ahead:
            return
        remaining = h.remaining_s(deadline_ns)
        if est.done_s <= remaining:
            return
        metrics.REFUSED_LATE.labels(*self._labels).inc()
        raise ResourceExhausted(
            f"model '{self.dv.model}' version '{self.dv.version}': {est.ahead} request(s) "
            f"would finish before this one could start here (in ~{est.wait_s:.1f} s); with "
            f"~{est.run_s:.1f} s to generate {max_tokens} tokens it would end after its "
            f"deadline ({remaining:.1f} s left); nothing was generated, retry later, ask "
            "for fewer tokens or allow a longer timeout",
            reason=LLM_LATE_REASON,
            retry_after_s=max(1.0, est.wait_s),
        )

    def _forget(self, rid: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(rid) is task:
            del self._tasks[rid]
            self._aborted.discard(rid)
        metrics.IN_FLIGHT.labels(*self._labels).set(len(self._tasks))
        self._intake_changed()

    async def _run(
        self, rid: str, request: GenerationRequest, reply: str, deadline_ns: int, frames: str = ""
    ) -> None:
        """Generate and stream one request; every outcome ends with one final chunk.

        `frames`: the gateway's chunk-frame subject ('' : one message per chunk).
        """
        t0 = time.monotonic()
        seq = 0
        status = "OK"
        prompt_tokens = completion = 0
        first_at = last_at = 0.0
        queued_s = 0.0
        engine_id = f"{rid}#{next(self._ids)}"  # unique in vLLM even if a client reuses ids
        try:
            remaining = h.remaining_s(deadline_ns)
            if remaining <= 0:
                raise DeadlineExceeded(f"request {rid} expired before generation started")
            # `aclosing`: a cancel or timeout that strikes while this task waits on
            # a publish (not inside the generator) still closes the generator at
            # once, and its `finally` aborts the request in vLLM. Left to garbage
            # collection, a generator kept alive by the exception's traceback
            # cycle went on generating until the next cyclic collection, which the
            # services' raised thresholds (`gc_thresholds`) make seconds away.
            async with asyncio.timeout(remaining):
                ids = self.engine.render(request)
                prompt_tokens = len(ids)
                steps = contextlib.aclosing(self.engine.generate(engine_id, request, ids))
                # Per-token series, looked up once (a labels() call costs more than the inc).
                inter_token = metrics.INTER_TOKEN_SECONDS.labels(*self._labels)
                generated = metrics.GENERATED_TOKENS.labels(*self._labels)
                async with steps as generation:
                    async for step in generation:
                        now = time.monotonic()
                        if step.tokens:
                            if not first_at:
                                first_at = now
                                metrics.TTFT_SECONDS.labels(*self._labels).observe(now - t0)
                            elif last_at:
                                inter_token.observe((now - last_at) / step.tokens)
                            last_at = now
                            completion += step.tokens
                            generated.inc(step.tokens)
                        if step.queue_s is not None:
                            queued_s = step.queue_s
                            metrics.QUEUE_SECONDS.labels(*self._labels).observe(step.queue_s)
                        chunk = GenerationChunk(
                            text=step.text,
                            tokens=step.tokens,
                            index=step.index,
                            logprobs=step.logprobs,
                            finish_reason=step.finish_reason,  # type: ignore[arg-type]  # vLLM reasons (stop, length, abort) are FinishReason values
                        )
                        final = step.done
                        if final:
                            chunk.prompt_tokens = prompt_tokens
                            chunk.completion_tokens = completion
                            chunk.timings_ms = {
                                "ttft": (first_at - t0) * 1000.0 if first_at else 0.0,
                                "total": (now - t0) * 1000.0,
                            }
                        if chunk.text or chunk.tokens or chunk.finish_reason or final:
                            await self._publish(reply, seq, chunk.encode(), {}, final, rid, frames)
                            seq += 1
                        # Neither vLLM's output queue (when a step is ready) nor a NATS
                        # publish (a buffer append) suspends: without this the loop would
                        # run until the request ends, starving the NATS flusher (no chunk
                        # leaves before the last), /metrics and the cancel subscription.
                        await asyncio.sleep(0)
            metrics.PROMPT_TOKENS.labels(*self._labels).inc(prompt_tokens)
            if first_at and last_at > first_at and completion > 1:
                metrics.TOKENS_PER_SECOND.labels(*self._labels).observe(
                    (completion - 1) / (last_at - first_at)
                )
                self.capacity.observe(
                    prefill_s=max(0.0, first_at - t0 - queued_s),
                    per_token_s=(last_at - first_at) / (completion - 1),
                    hold_s=max(0.0, last_at - t0 - queued_s),
                )
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            metrics.ABORTED.labels(*self._labels, "deadline").inc()
            exc = DeadlineExceeded(f"request {rid} passed its deadline while generating")
            with contextlib.suppress(*NATS_ERRORS):
                await self._publish(reply, seq, b"", error_headers(exc, rid), True, rid)
        except asyncio.CancelledError:
            # A cancel from the gateway (client gone: nobody waits for a final chunk),
            # shutdown, or a dead engine's recovery; `LlmEngine.generate` aborted the
            # engine request (a dead engine has none left).
            status = "ABORTED"
            failure: Unavailable | None = None
            if self.down:
                status = "UNAVAILABLE"
                failure = EngineDead()
            elif self._stopping:
                metrics.ABORTED.labels(*self._labels, "shutdown").inc()
                failure = Unavailable(f"the LLM worker stopped while generating {rid}; retry")
            if failure is not None:
                with contextlib.suppress(*NATS_ERRORS):
                    await self._publish(reply, seq, b"", error_headers(failure, rid), True, rid)
            raise
        except Exception as exc:
            code, _ = status_of(exc)
            status = code.name
            if isinstance(exc, EngineDead):
                self.engine_died(f"request {rid} found it dead")
            elif not isinstance(exc, InferbusError):
                log.exception("generation failed", extra={"request_id": rid})
            with contextlib.suppress(*NATS_ERRORS):
                await self._publish(reply, seq, b"", error_headers(exc, rid), True, rid)
        finally:
            metrics.REQUESTS.labels(*self._labels, status).inc()


def _split_frames(entries: list[tuple[str, bytes]], limit: int) -> list[tuple[list[str], bytes]]:
    """Pack (request id, packed chunk) entries, in order, into frames of at most
    `limit` bytes each (every entry alone fits: `_publish` sends larger ones single)."""
    out: list[tuple[list[str], bytes]] = []
    rids: list[str] = []
    parts: list[bytes] = []
    size = 0
    for rid, entry in entries:
        if parts and size + len(entry) > limit:
            out.append((rids, b"".join(parts)))
            rids, parts, size = [], [], 0
        rids.append(rid)
        parts.append(entry)
        size += len(entry)
    if parts:
        out.append((rids, b"".join(parts)))
    return out
