"""The gateway's side of stateful models: send each request of a sequence to its worker.

A sequence model's requests skip the router, the batcher and the work queue
(where any worker could take them): the gateway publishes each one on the
subject of the one worker that holds the sequence,
``ib.seq.<worker>.<model>.<version>``, and waits for its single reply. Which
worker:

* a ``sequence_start`` request goes to the worker this gateway already bound
  the sequence to if it still serves the version, else to the one chosen by
  rendezvous hashing over the workers that report the version ready
  (`inferbus_common.sequences.place`; every gateway picks the same one);
* a later request goes to the worker bound at its start. A gateway that has
  not seen the sequence (another gateway took its start, or this one
  restarted) asks every ready worker of the version once on
  ``ib.seqwho.<model>.<version>`` and binds the one that answers it holds it;
  none holds it: FAILED_PRECONDITION naming the sequence.

A bound worker that no longer serves the version (no fresh heartbeat, or
nats-server answers "no responders" on its subject) is UNAVAILABLE naming
the sequence and the worker: its state is gone, the client must start the
sequence again. Requests of one sequence are sent one at a time, in the
order they were taken (`SequenceRouter.turn`), so a stream's requests
cannot overtake each other. Details: docs/architecture.md ("Sequences").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter

from inferbus_common.catalog import Catalog, DeployedVersion
from inferbus_common.codec import Tensor
from inferbus_common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_common.sequences import (
    SequenceFlags,
    check_sequence_id,
    describe,
    encode_sequence_id,
    place,
)
from inferbus_common.subjects import Subjects
from inferbus_gateway.dispatch.dispatcher import Reply

log = logging.getLogger(__name__)

SEQUENCE_REQUESTS = Counter(
    "inferbus_gateway_sequence_requests_total",
    "Requests of stateful models sent to the worker holding their sequence, by how "
    "the worker was found (placed: a start; bound: known to this gateway; located: "
    "asked the workers).",
    ["model", "how"],
)
SEQUENCE_LOST = Counter(
    "inferbus_gateway_sequence_refusals_total",
    "Sequence requests refused before reaching a worker, by why (not-active: no worker "
    "holds the sequence; worker-gone: the worker holding it stopped serving).",
    ["model", "why"],
)

_MAX_BINDINGS = 100_000
"""Sequences whose worker a gateway remembers (the oldest are forgotten first;
a forgotten one is located again on its next request)."""
_LOCATE_TIMEOUT_S = 0.5
"""How long a locate question waits for the workers' answers (bounded by the
request's deadline)."""

_Key = tuple[str, str, str]


class SequenceTurn:
    """A request's place in its sequence's order: it may go once `ready` is done."""

    __slots__ = ("done", "ready")

    def __init__(self, ready: asyncio.Future[None] | None, done: asyncio.Future[None]) -> None:
        self.ready = ready
        self.done = done

    async def wait(self) -> None:
        """Wait until the sequence's previous request has been answered."""
        if self.ready is not None and not self.ready.done():
            await asyncio.shield(self.ready)

    def release(self) -> None:
        """Let the sequence's next request go (idempotent)."""
        if not self.done.done():
            self.done.set_result(None)


def sequence_flags(params: dict[str, object]) -> SequenceFlags | None:
    """Triton's sequence parameters of a request (None: not part of a sequence).

    Raises:
        InvalidArgument: a mistyped id or flag, or a flag without an id.
    """
    for key in ("sequence_start", "sequence_end"):
        if key in params and not isinstance(params[key], bool):
            raise InvalidArgument(f"parameter '{key}' must be a bool, got {params[key]!r}")
    sid = check_sequence_id(params.get("sequence_id", 0))
    if sid is None:
        if params.get("sequence_start") or params.get("sequence_end"):
            raise InvalidArgument("sequence_start/sequence_end need a non-zero sequence_id")
        return None
    return SequenceFlags(
        sid, bool(params.get("sequence_start", False)), bool(params.get("sequence_end", False))
    )


def check_sequence_request(dv: DeployedVersion, flags: SequenceFlags | None) -> None:
    """Refuse requests that do not fit the model's sequence batching.

    Raises:
        InvalidArgument: a sequence model without a sequence id, a sequence id
            for a model without sequence batching, or a string id for a model
            whose CORRID control takes integers.
    """
    seq = dv.config.sequence_batching
    if seq is None:
        if flags is not None:
            raise InvalidArgument(
                f"model '{dv.model}' is not a sequence model (no sequence_batching in its "
                "config); send it no sequence_id"
            )
        return
    if flags is None:
        raise InvalidArgument(
            f"model '{dv.model}' is a sequence model: every request must carry a non-zero "
            "or non-empty sequence_id (with sequence_start on its first request)"
        )
    corrid = next((c for c in seq.controls if c.kind == "corrid"), None)
    if corrid is not None and corrid.datatype != "BYTES" and isinstance(flags.id, str):
        raise InvalidArgument(
            f"model '{dv.model}' takes integer sequence ids (its CORRID control is "
            f"{corrid.datatype}); got the string {flags.id!r}"
        )


class SequenceRouter:
    """Sends sequence requests to the worker holding their sequence (module docstring).

    Args:
        nc: connected NATS client.
        catalog: live catalog (ready workers of a version).
        subjects: naming scheme.
        max_bindings: sequences whose worker is remembered.
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        subjects: Subjects,
        *,
        max_bindings: int = _MAX_BINDINGS,
    ) -> None:
        self._nc = nc
        self._catalog = catalog
        self._subjects = subjects
        self._max = max_bindings
        self._bound: OrderedDict[_Key, str] = OrderedDict()
        self._last: dict[_Key, asyncio.Future[None]] = {}

    @property
    def bound(self) -> int:
        """Sequences whose worker this gateway knows."""
        return len(self._bound)

    def turn(self, model: str, version: str, flags: SequenceFlags) -> SequenceTurn:
        """Take the next place in a sequence's order (call in the order requests came).

        `model` and `version` are as the client named them (an empty version is
        the stable one): requests that name the version differently are ordered
        apart, which only matters for requests sent without waiting.
        """
        key = (model, version, encode_sequence_id(flags.id))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        previous = self._last.get(key)
        self._last[key] = done

        def forget(_: object, key: _Key = key, done: asyncio.Future[None] = done) -> None:
            if self._last.get(key) is done:
                del self._last[key]

        done.add_done_callback(forget)
        return SequenceTurn(previous, done)

    def _ready_workers(self, dv: DeployedVersion) -> list[str]:
        return sorted(w.worker_id for w in self._catalog.ready_workers(dv.model, dv.version))

    def _bind(self, key: _Key, worker: str) -> None:
        self._bound[key] = worker
        self._bound.move_to_end(key)
        while len(self._bound) > self._max:
            self._bound.popitem(last=False)

    async def call(
        self,
        dv: DeployedVersion,
        flags: SequenceFlags,
        *,
        request_id: str,
        tensors: list[Tensor],
        outputs: Sequence[str],
        deadline_ns: int,
        traceparent: str = "",
        turn: SequenceTurn | None = None,
    ) -> Reply:
        """Send one request of a sequence to its worker and wait for the reply.

        Raises:
            FailedPrecondition: no worker holds the sequence (not started, ended,
                or freed after its idle timeout).
            Unavailable: no worker serves the version, or the one holding the
                sequence is gone (its state with it).
            DeadlineExceeded: no reply before the deadline.
        """
        own = turn is None
        if turn is None:
            turn = self.turn(dv.model, dv.version, flags)
        try:
            await turn.wait()
            return await self._send(
                dv, flags, request_id, encode_tensors(tensors), outputs, deadline_ns, traceparent
            )
        finally:
            if own:
                turn.release()

    async def _send(
        self,
        dv: DeployedVersion,
        flags: SequenceFlags,
        request_id: str,
        frame: bytes,
        outputs: Sequence[str],
        deadline_ns: int,
        traceparent: str,
    ) -> Reply:
        key = (dv.model, dv.version, encode_sequence_id(flags.id))
        worker = await self._worker_for(dv, key, flags, deadline_ns)
        headers = {
            h.REQUEST_ID: request_id,
            h.DEADLINE: str(deadline_ns),
            h.MODEL: dv.model,
            h.VERSION: dv.version,
            h.SEQUENCE_ID: key[2],
        }
        if flags.flags:
            headers[h.SEQUENCE_FLAGS] = flags.flags
        if outputs:
            headers[h.OUTPUTS] = ",".join(outputs)
        if traceparent:
            headers[h.TRACEPARENT] = traceparent
        remaining = h.remaining_s(deadline_ns)
        if remaining <= 0:
            raise DeadlineExceeded(f"request {request_id} passed its deadline before it was sent")
        subject = self._subjects.sequence(worker, dv.model, dv.version)
        try:
            msg = await self._nc.request(subject, frame, timeout=remaining, headers=headers)
        except NoRespondersError:
            self._bound.pop(key, None)
            SEQUENCE_LOST.labels(dv.model, "worker-gone").inc()
            raise Unavailable(self._gone(dv, flags, worker)) from None
        except (TimeoutError, NatsTimeout):
            raise DeadlineExceeded(
                f"request {request_id} of sequence {describe(flags.id)} got no answer before "
                "its deadline"
            ) from None
        reply = Reply.from_msg(msg)
        if reply.status == "FAILED_PRECONDITION" or (flags.end and not reply.status):
            # The worker does not hold it (any more), or it ended: forget the binding.
            self._bound.pop(key, None)
        return reply

    async def _worker_for(
        self, dv: DeployedVersion, key: _Key, flags: SequenceFlags, deadline_ns: int
    ) -> str:
        ready = self._ready_workers(dv)
        bound = self._bound.get(key)
        if flags.start:
            if bound is not None and bound in ready:
                self._bound.move_to_end(key)
                SEQUENCE_REQUESTS.labels(dv.model, "bound").inc()
                return bound  # a restart: the worker that held it resets its state
            worker = place(ready, dv.model, dv.version, flags.id)
            if worker is None:
                raise Unavailable(
                    f"model '{dv.model}' version '{dv.version}' has no ready worker to start "
                    f"sequence {describe(flags.id)} on"
                )
            self._bind(key, worker)
            SEQUENCE_REQUESTS.labels(dv.model, "placed").inc()
            return worker
        if bound is not None:
            if bound not in ready:
                self._bound.pop(key, None)
                SEQUENCE_LOST.labels(dv.model, "worker-gone").inc()
                raise Unavailable(self._gone(dv, flags, bound))
            self._bound.move_to_end(key)
            SEQUENCE_REQUESTS.labels(dv.model, "bound").inc()
            return bound
        worker = await self._locate(dv, key, ready, deadline_ns)
        if worker is None:
            SEQUENCE_LOST.labels(dv.model, "not-active").inc()
            idle_ms = (
                dv.config.sequence_batching.max_sequence_idle_us / 1000
                if dv.config.sequence_batching
                else 0
            )
            raise FailedPrecondition(
                f"sequence {describe(flags.id)} of model '{dv.model}' is not active on any "
                f"worker: its first request must set sequence_start, and a sequence is "
                f"freed after its end or {idle_ms:g} ms without a request "
                "(max_sequence_idle_us)"
            )
        self._bind(key, worker)
        SEQUENCE_REQUESTS.labels(dv.model, "located").inc()
        return worker

    async def _locate(
        self, dv: DeployedVersion, key: _Key, ready: list[str], deadline_ns: int
    ) -> str | None:
        """Ask every ready worker of the version whether it holds the sequence."""
        if not ready:
            return None
        inbox = self._nc.new_inbox()
        answers: asyncio.Queue[Msg] = asyncio.Queue()

        async def collect(msg: Msg) -> None:
            answers.put_nowait(msg)

        sub = await self._nc.subscribe(inbox, cb=collect)
        try:
            await self._nc.publish(
                self._subjects.sequence_locate(dv.model, dv.version),
                b"",
                reply=inbox,
                headers={h.SEQUENCE_ID: key[2]},
            )
            wait = max(0.0, min(_LOCATE_TIMEOUT_S, h.remaining_s(deadline_ns)))
            heard = 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    while heard < len(ready):
                        msg = await answers.get()
                        heard += 1
                        if msg.data:
                            return msg.data.decode("utf-8", "replace")
            return None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _gone(self, dv: DeployedVersion, flags: SequenceFlags, worker: str) -> str:
        return (
            f"sequence {describe(flags.id)} of model '{dv.model}' was held by worker "
            f"{worker}, which no longer serves version '{dv.version}'; its state is lost: "
            "start the sequence again"
        )
