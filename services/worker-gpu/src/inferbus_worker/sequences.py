"""Serving a stateful model version: Triton's sequence batcher on one worker.

A version whose config has ``sequence_batching`` is served by a
`SequenceRunner` instead of a `ModelRunner`: its requests do not go through
the batcher and the work queue (any worker could pull them there) but come
straight from the gateway on this worker's own subject
``ib.seq.<worker>.<model>.<version>``, because every request of a sequence
must reach the worker that holds its state. The runner keeps, per sequence,
its implicit state tensors and a queue of its requests, computed one at a
time in arrival order; requests of *different* sequences that are ready at
the same moment run as one engine batch, one row each (Triton's ``oldest``
strategy). Every row gets the control inputs the config names (START, END,
READY, CORRID). A sequence is freed after its END request, or when no
request came for ``max_sequence_idle_us``; a request for a sequence this
worker does not hold (never started here, ended, or freed) is answered
FAILED_PRECONDITION.

The runner also answers "who holds sequence X" questions on
``ib.seqwho.<model>.<version>`` (a gateway that has not seen the sequence
asks every worker of the version). Design and limits: docs/architecture.md
("Sequences").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import nats.errors
import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common.catalog import DeployedVersion
from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.datatypes import BYTES, numpy_dtype
from inferbus_common.errors import (
    FailedPrecondition,
    InferbusError,
    InvalidArgument,
    ResourceExhausted,
    StatusCode,
    Unavailable,
)
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.framing import FrameError, one_line
from inferbus_common.protocol.microbatch import BatchEntry
from inferbus_common.protocol.tensors import decode_tensors, encode_tensors
from inferbus_common.sequencebatching import SequenceBatchingConfig, SequenceControl
from inferbus_common.sequences import (
    SequenceFlags,
    SequenceId,
    decode_sequence_id,
    describe,
    encode_sequence_id,
)
from inferbus_common.subjects import Subjects
from inferbus_common.validation import RequestChecker
from inferbus_worker import metrics
from inferbus_worker.engines import Engine, EngineError, EngineInputError
from inferbus_worker.microbatch import LiveRequest
from inferbus_worker.stats import VersionCounters

log = logging.getLogger(__name__)

SEQUENCE_SLOTS_REASON = "sequence-slots"
"""`ResourceExhausted.reason` when a worker holds `max_sequences` sequences of a version."""

_NATS_ERRORS = (nats.errors.Error, OSError)


@dataclass(slots=True, eq=False)
class _Request:
    """One request of a sequence, waiting for its turn."""

    msg: Msg
    request_id: str
    flags: SequenceFlags
    deadline_ns: int
    received_ns: int
    tensors: list[Tensor]
    outputs: tuple[str, ...]


@dataclass(slots=True, eq=False)
class _Sequence:
    """What the worker holds for one sequence."""

    id: SequenceId
    state: dict[str, np.ndarray] | None = None
    """Implicit state after the last computed request (None: not started, or
    its start request failed)."""
    pending: deque[_Request] = field(default_factory=deque)
    running: bool = False
    last_active: float = 0.0
    """Monotonic time of its last request (arrival or answer)."""


def _flag_value(control: SequenceControl, on: bool) -> float:
    return control.false_true[1] if on else control.false_true[0]


class SequenceRunner:
    """Serves one stateful version on this worker (see the module docstring).

    Has the same surface the worker uses for a `ModelRunner`: `start`,
    `stop` and `stats`.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        worker_id: this worker's id (names its subject; the gateway learns it
            from the heartbeat).
        deployed: the version served.
        engine: its engine, loaded and warmed up; the runner closes it.
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        worker_id: str,
        deployed: DeployedVersion,
        engine: Engine,
    ) -> None:
        assert deployed.config.sequence_batching is not None
        self._nc = nc
        self._subjects = subjects
        self._worker_id = worker_id
        self.deployed = deployed
        self._config = deployed.config
        self._seq: SequenceBatchingConfig = deployed.config.sequence_batching
        self._batched = self._config.max_batch_size > 0
        self._batch_limit = self._config.max_batch_size if self._batched else 1
        self._checker = RequestChecker(self._config)
        self._engine = engine
        self._slots = self._config.instance_count
        self._free = self._slots
        self._pool = ThreadPoolExecutor(
            max_workers=self._slots, thread_name_prefix=f"seq-{deployed.model}"
        )
        self._client_outputs = [s.name for s in self._config.outputs]
        self._state_outputs = [s.output for s in self._seq.states]
        self._idle_s = self._seq.max_sequence_idle_us / 1e6
        self._delay_s = self._seq.max_queue_delay_us / 1e6
        self._sequences: dict[str, _Sequence] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._runs: set[asyncio.Task[None]] = set()
        self._labels = {"model": deployed.model, "version": deployed.version}
        self._log_extra = dict(self._labels)
        self.stats = VersionCounters()
        """Cumulative statistics, reported in the heartbeat (Triton's statistics)."""

    @property
    def sequences(self) -> int:
        """Sequences this worker holds now (started, or with requests queued)."""
        return len(self._sequences)

    async def start(self) -> None:
        """Subscribe to this worker's sequence subject and the locate questions."""
        model, version = self.deployed.model, self.deployed.version
        self._subs.append(
            await self._nc.subscribe(
                self._subjects.sequence(self._worker_id, model, version), cb=self._on_request
            )
        )
        self._subs.append(
            await self._nc.subscribe(
                self._subjects.sequence_locate(model, version), cb=self._on_locate
            )
        )
        self._tasks.append(asyncio.create_task(self._schedule(), name=f"seq-{model}-{version}"))
        self._tasks.append(asyncio.create_task(self._sweep(), name=f"seq-idle-{model}-{version}"))
        metrics.EXECUTION_SLOTS.labels(**self._labels).set(self._slots)
        metrics.BUSY_SLOTS.labels(**self._labels).set_function(lambda: self._slots - self._free)
        metrics.SEQUENCES.labels(**self._labels).set_function(lambda: len(self._sequences))

    async def stop(self) -> None:
        """Stop taking requests, finish the ones queued, free every sequence, close."""
        self._stopping = True
        for sub in self._subs:
            with contextlib.suppress(*_NATS_ERRORS):
                await sub.unsubscribe()
        self._subs.clear()
        # Requests already queued are computed (their clients wait for them).
        while any(s.pending or s.running for s in self._sequences.values()):
            self._wake.set()
            await asyncio.sleep(0.005)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._runs, return_exceptions=True)
        self._tasks.clear()
        freed = len(self._sequences)
        if freed:
            metrics.SEQUENCES_FREED.labels(**self._labels, why="stopped").inc(freed)
            log.info("freed %d sequences on stop", freed, extra=self._log_extra)
        self._sequences.clear()
        for gauge in (metrics.EXECUTION_SLOTS, metrics.BUSY_SLOTS, metrics.SEQUENCES):
            with contextlib.suppress(KeyError):
                gauge.remove(self.deployed.model, self.deployed.version)
        self._pool.shutdown(wait=True)
        await asyncio.to_thread(self._engine.close)

    # --- intake ------------------------------------------------------------------
    async def _on_locate(self, msg: Msg) -> None:
        """Answer whether this worker holds a sequence (body: our id, or empty)."""
        if not msg.reply:
            return
        key = (msg.headers or {}).get(h.SEQUENCE_ID, "")
        held = key in self._sequences and not self._stopping
        with contextlib.suppress(*_NATS_ERRORS):
            await self._nc.publish(msg.reply, self._worker_id.encode() if held else b"")

    async def _on_request(self, msg: Msg) -> None:
        headers = msg.headers or {}
        request_id = headers.get(h.REQUEST_ID, "")
        try:
            request = self._decode(msg, headers, request_id)
            self._admit(request)
        except InferbusError as exc:
            await self._reply_error(msg, request_id, exc)
            return
        self._wake.set()

    def _decode(self, msg: Msg, headers: dict[str, str], request_id: str) -> _Request:
        sid = decode_sequence_id(headers.get(h.SEQUENCE_ID, ""))
        flags = SequenceFlags.from_flags(sid, headers.get(h.SEQUENCE_FLAGS, ""))
        try:
            tensors = sorted(decode_tensors(msg.data), key=lambda t: t.name)
        except FrameError as exc:
            raise InvalidArgument(f"malformed request frame: {exc.message}") from None
        outputs = tuple(o for o in headers.get(h.OUTPUTS, "").split(",") if o)
        self._checker.check(tensors, outputs, trusted=True)
        if self._batched and any(t.shape[0] != 1 for t in tensors):
            raise InvalidArgument(
                f"{self._config.name}: a request of a sequence model carries one row (batch size 1)"
            )
        deadline = headers.get(h.DEADLINE, "")
        return _Request(
            msg,
            request_id,
            flags,
            int(deadline) if deadline.isdigit() else 0,
            time.time_ns(),
            tensors,
            outputs,
        )

    def _admit(self, request: _Request) -> None:
        """Queue a request on its sequence (creating the sequence on a start).

        Raises:
            Unavailable: the worker is stopping.
            FailedPrecondition: a request for a sequence this worker does not hold.
            ResourceExhausted: a start while `max_sequences` are held.
        """
        flags = request.flags
        key = encode_sequence_id(flags.id)
        if self._stopping:
            raise Unavailable(
                f"the worker holding sequence {describe(flags.id)} is stopping; its state is "
                "lost: start the sequence again"
            )
        seq = self._sequences.get(key)
        if seq is None:
            if not flags.start:
                raise FailedPrecondition(self._not_held(flags.id))
            if len(self._sequences) >= self._seq.max_sequences:
                raise ResourceExhausted(
                    f"worker {self._worker_id} holds {len(self._sequences)} sequences of "
                    f"{self._config.name} (max_sequences); end sequences or add workers",
                    reason=SEQUENCE_SLOTS_REASON,
                )
            seq = self._sequences[key] = _Sequence(flags.id)
        seq.pending.append(request)
        seq.last_active = time.monotonic()

    def _not_held(self, sid: SequenceId) -> str:
        idle_ms = self._seq.max_sequence_idle_us / 1000
        return (
            f"sequence {describe(sid)} of model '{self.deployed.model}' is not active on "
            f"worker {self._worker_id}: its first request must set sequence_start, and a "
            f"sequence is freed after its end or {idle_ms:g} ms without a request "
            "(max_sequence_idle_us)"
        )

    # --- scheduling ----------------------------------------------------------------
    def _ready(self) -> list[_Sequence]:
        """Sequences with a request waiting and none running, oldest request first."""
        ready = [s for s in self._sequences.values() if s.pending and not s.running]
        ready.sort(key=lambda s: s.pending[0].received_ns)
        return ready

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._free > 0:
                ready = self._ready()
                if not ready:
                    break
                if self._delay_s and len(ready) < self._batch_limit and not self._stopping:
                    waited = (time.time_ns() - ready[0].pending[0].received_ns) / 1e9
                    if waited < self._delay_s:
                        # Let requests of other sequences join this batch for a while.
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self._delay_s - waited):
                                await self._wake.wait()
                        self._wake.clear()
                        continue
                group = self._group(ready)
                for seq, _ in group:
                    seq.running = True
                self._free -= 1
                task = asyncio.create_task(self._run(group))
                self._runs.add(task)
                task.add_done_callback(self._finished)

    def _group(self, ready: list[_Sequence]) -> list[tuple[_Sequence, _Request]]:
        """The next requests of up to `_batch_limit` sequences whose tensors can share
        a batch (same names, datatypes and row shapes as the oldest one's)."""
        first = ready[0]
        head = first.pending.popleft()
        group = [(first, head)]
        signature = [(t.name, t.datatype, tuple(t.shape[1:])) for t in head.tensors]
        for seq in ready[1:]:
            if len(group) >= self._batch_limit:
                break
            candidate = seq.pending[0]
            if [(t.name, t.datatype, tuple(t.shape[1:])) for t in candidate.tensors] == signature:
                group.append((seq, seq.pending.popleft()))
        return group

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._runs.discard(task)
        self._free += 1
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("sequence run crashed: %r", task.exception(), extra=self._log_extra)

    async def _sweep(self) -> None:
        """Free sequences idle for longer than ``max_sequence_idle_us``."""
        interval = min(1.0, max(0.01, self._idle_s / 4))
        while True:
            await asyncio.sleep(interval)
            cutoff = time.monotonic() - self._idle_s
            idle = [
                k
                for k, s in self._sequences.items()
                if not s.pending and not s.running and s.last_active < cutoff
            ]
            for key in idle:
                del self._sequences[key]
            if idle:
                metrics.SEQUENCES_FREED.labels(**self._labels, why="idle").inc(len(idle))
                log.info(
                    "freed %d idle sequences (no request for %g ms)",
                    len(idle),
                    self._idle_s * 1000,
                    extra=self._log_extra,
                )

    # --- execution -----------------------------------------------------------------
    async def _run(self, group: list[tuple[_Sequence, _Request]]) -> None:
        try:
            live = await self._refuse_stale(group)
            if live:
                await self._compute(live)
        finally:
            now = time.monotonic()
            for seq, request in group:
                seq.running = False
                seq.last_active = now
                self._retire(seq, request)

    def _retire(self, seq: _Sequence, request: _Request) -> None:
        """Free a sequence after its end request (unless a new start is queued)."""
        if request.flags.end and not seq.pending:
            key = encode_sequence_id(seq.id)
            if self._sequences.get(key) is seq:
                del self._sequences[key]
                metrics.SEQUENCES_FREED.labels(**self._labels, why="end").inc()

    async def _refuse_stale(
        self, group: list[tuple[_Sequence, _Request]]
    ) -> list[tuple[_Sequence, _Request]]:
        """Answer expired requests and requests whose sequence has no state; the rest."""
        now = time.time_ns()
        live = []
        for seq, request in group:
            if request.deadline_ns and request.deadline_ns <= now:
                await self._reply_error(
                    request.msg,
                    request.request_id,
                    InferbusError("deadline passed before the model ran"),
                    code=StatusCode.DEADLINE_EXCEEDED,
                )
                continue
            if not request.flags.start and seq.state is None:
                await self._reply_error(
                    request.msg,
                    request.request_id,
                    FailedPrecondition(
                        f"sequence {describe(seq.id)} has no state: its start request failed "
                        "or expired; start the sequence again"
                    ),
                )
                continue
            live.append((seq, request))
        return live

    def _controls(self, group: Sequence[tuple[_Sequence, _Request]]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        lead = (len(group), 1) if self._batched else (1,)
        for c in self._seq.controls:
            if c.kind == "corrid":
                ids = [seq.id for seq, _ in group]
                if c.datatype == BYTES:
                    arr = np.empty(len(ids), dtype=object)
                    arr[:] = [str(i).encode("utf-8") for i in ids]
                else:
                    arr = np.array(ids, dtype=numpy_dtype(c.datatype))
                out[c.name] = arr.reshape(lead)
                continue
            if c.kind == "ready":
                values = [_flag_value(c, True) for _ in group]
            else:
                attr = "start" if c.kind == "start" else "end"
                values = [_flag_value(c, getattr(r.flags, attr)) for _, r in group]
            out[c.name] = np.array(values, dtype=numpy_dtype(c.datatype)).reshape(lead)
        return out

    def _states(self, group: Sequence[tuple[_Sequence, _Request]]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for s in self._seq.states:
            dtype = numpy_dtype(s.datatype)
            rows = []
            for seq, request in group:
                current = None if request.flags.start or seq.state is None else seq.state[s.input]
                rows.append(current if current is not None else np.zeros(s.shape, dtype=dtype))
            out[s.input] = np.stack(rows) if self._batched else rows[0]
        return out

    def _inputs(self, group: Sequence[tuple[_Sequence, _Request]]) -> dict[str, np.ndarray]:
        inputs: dict[str, np.ndarray] = {}
        names = [t.name for t in group[0][1].tensors]
        for i, name in enumerate(names):
            arrays = [r.tensors[i].as_numpy() for _, r in group]
            inputs[name] = np.concatenate(arrays, axis=0) if self._batched else arrays[0]
        inputs.update(self._controls(group))
        inputs.update(self._states(group))
        return inputs

    async def _compute(self, group: list[tuple[_Sequence, _Request]]) -> None:
        try:
            inputs = self._inputs(group)
        except InferbusError as exc:
            for _, request in group:
                await self._reply_error(request.msg, request.request_id, exc)
            return
        loop = asyncio.get_running_loop()
        start_ns = time.time_ns()
        t0 = time.monotonic()
        try:
            outputs = await loop.run_in_executor(
                self._pool, self._engine.run, inputs, [*self._client_outputs, *self._state_outputs]
            )
        except EngineInputError as exc:
            if len(group) > 1:
                # One sequence's row is usually at fault: each alone, so only it fails.
                for one in group:
                    await self._compute([one])
                return
            await self._fail(group, StatusCode.INVALID_ARGUMENT, exc.message)
            return
        except EngineError as exc:
            # No redelivery here (the request is not in the work queue) and the
            # state must not run twice: the sequence keeps its state, the client
            # may send the request again.
            log.warning("sequence run failed: %s", exc, extra=self._log_extra)
            await self._fail(group, StatusCode.INTERNAL, f"the model failed to run: {exc.message}")
            return
        compute_s = time.monotonic() - t0
        await self._answer(group, outputs, start_ns, compute_s)
        rows = len(group) if self._batched else 1
        metrics.ROWS.labels(**self._labels).inc(rows)
        metrics.BATCH_SIZE.labels(**self._labels).observe(rows)
        metrics.COMPUTE_SECONDS.labels(**self._labels).observe(compute_s)
        metrics.BATCHES.labels(**self._labels, outcome="ok").inc()
        self.stats.executed(
            [
                LiveRequest(BatchEntry(r.request_id, "", r.deadline_ns, r.received_ns, 1), i)
                for i, (_, r) in enumerate(group)
            ],
            start_ns,
            compute_s,
            {},
            time.monotonic() - t0,
        )

    async def _answer(
        self,
        group: list[tuple[_Sequence, _Request]],
        outputs: dict[str, np.ndarray],
        start_ns: int,
        compute_s: float,
    ) -> None:
        for row, (seq, request) in enumerate(group):
            if self._batched:
                seq.state = {s.input: np.array(outputs[s.output][row]) for s in self._seq.states}
                tensors = [
                    tensor_from_numpy(name, outputs[name][row : row + 1])
                    for name in request.outputs or self._client_outputs
                ]
            else:
                seq.state = {s.input: np.array(outputs[s.output]) for s in self._seq.states}
                tensors = [
                    tensor_from_numpy(name, outputs[name])
                    for name in request.outputs or self._client_outputs
                ]
            queue_ms = max(0.0, (start_ns - request.received_ns) / 1e6)
            headers = {
                h.REQUEST_ID: request.request_id,
                h.VERSION: self.deployed.version,
                h.DIGEST: self.deployed.digest,
                h.TIMINGS: h.format_timings({"queue": queue_ms, "compute": compute_s * 1000}),
                h.BATCH_SIZE: str(len(group)),
            }
            await self._respond(request.msg, encode_tensors(tensors), headers)
            metrics.REPLIES.labels(**self._labels, status="OK").inc()

    async def _fail(
        self, group: list[tuple[_Sequence, _Request]], code: StatusCode, message: str
    ) -> None:
        for _, request in group:
            await self._reply_error(request.msg, request.request_id, InferbusError(message), code)
        metrics.BATCHES.labels(
            **self._labels, outcome="invalid" if code is StatusCode.INVALID_ARGUMENT else "failed"
        ).inc()

    async def _reply_error(
        self,
        msg: Msg,
        request_id: str,
        exc: InferbusError,
        code: StatusCode | None = None,
    ) -> None:
        status = code or exc.code
        headers = {
            h.REQUEST_ID: request_id,
            h.VERSION: self.deployed.version,
            h.DIGEST: self.deployed.digest,
            h.STATUS: status.name,
            h.ERROR: one_line(exc.message),
        }
        if isinstance(exc, ResourceExhausted) and exc.reason:
            headers[h.REASON] = exc.reason
        await self._respond(msg, b"", headers)
        metrics.REPLIES.labels(**self._labels, status=status.name).inc()
        self.stats.failed(1)

    async def _respond(self, msg: Msg, body: bytes, headers: dict[str, str]) -> None:
        if not msg.reply:
            return
        try:
            await self._nc.publish(msg.reply, body, headers=headers)
        except _NATS_ERRORS as exc:  # the gateway then answers at the request's deadline
            log.warning("could not answer a sequence request: %s", exc, extra=self._log_extra)
