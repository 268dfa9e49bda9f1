"""The fast lane of a `ModelRunner`: requests straight from a gateway over core NATS.

A gateway that sends a lone request on a plain route (a decided version, no
shadow), or a bundle it held until a reply told it an execution slot had just
finished a batch, publishes its request bundle to ``<prefix>.fast.<model>.<version>``
(a core NATS queue group of the version's workers) instead of the batcher.
A worker with a free execution slot runs it through the same code as a
micro-batch (`ModelRunner._handle`) and answers with the normal reply
bundle. A worker without one, or one that cannot take the bundle, answers
``busy`` on the message's reply subject: the gateway then sends the very
same bundle the normal way (batcher, JetStream) at once. While the run lasts
the worker sends an empty keep-alive on that reply subject (with the
JetStream keep-alives); a gateway that hears neither an answer nor a
keep-alive within its retry time sends the bundle the normal way (a killed
worker), and keeps the first answer per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.aio.msg import Msg

from inferbus_common.catalogrecords import DeployedVersion
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import decode_request_bundle
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.microbatch import BatchEntry, MicroBatch
from inferbus_common.protocol.tensors import batch_signature, decode_tensors, join_tensors
from inferbus_worker.pullloop import NATS_ERRORS

log = logging.getLogger(__name__)

BUSY = b"busy"
"""The refusal a worker answers on a fast-lane message's reply subject."""


@dataclass(slots=True)
class _Metadata:
    num_delivered: int = 1


class FastMsg:
    """Stands for a JetStream message in `ModelRunner._handle` for a fast-lane request:
    acks and terms are nothing (nothing to redeliver); a nak (a transient engine
    failure, a crash) sends the gateway to the normal path; ``in_progress`` is a
    keep-alive to the gateway."""

    __slots__ = ("_nc", "_reply", "metadata")

    def __init__(self, nc: Client, reply: str) -> None:
        self._nc = nc
        self._reply = reply
        self.metadata = _Metadata()

    async def ack(self) -> None:
        return None

    async def term(self) -> None:
        return None

    async def nak(self, delay: float | None = None) -> None:
        if self._reply:
            await self._nc.publish(self._reply, BUSY)

    async def in_progress(self) -> None:
        if self._reply:
            await self._nc.publish(self._reply, b"")


def fast_batch(data: bytes, max_rows: int) -> MicroBatch | None:
    """The micro-batch of a fast-lane request bundle; None when it cannot run as one
    (undecodable; several requests whose tensors differ in names, datatypes or
    non-batch dimensions, or hold more than `max_rows` rows, or a model that does not
    batch, ``max_rows`` 0): the gateway then goes the normal way."""
    try:
        bundle = decode_request_bundle(data)
        per_request = [decode_tensors(r.frame) for r in bundle.requests]
    except FrameError:
        return None
    if not per_request:
        return None
    now = h.now_ns()
    entries = []
    total = 0
    for r, tensors in zip(bundle.requests, per_request, strict=True):
        env = r.envelope
        rows = tensors[0].shape[0] if tensors and tensors[0].shape else 1
        total += rows
        entries.append(
            BatchEntry(
                env.request_id,
                bundle.inbox,
                env.deadline_ns,
                now,
                rows,
                env.outputs,
                env.traceparent,
                r.mirror,
                r.token,
                r.mirror_token,
            )
        )
    if len(entries) == 1:
        return MicroBatch(entries, per_request[0])
    signature = batch_signature(per_request[0])
    if total > max_rows or any(batch_signature(t) != signature for t in per_request[1:]):
        return None
    return MicroBatch(entries, join_tensors(per_request))


class FastLane:
    """Takes fast-lane requests while a slot is free (a mixin of `ModelRunner`)."""

    _nc: Client
    _free: int
    _stopping: asyncio.Event
    _inflight: set[asyncio.Task[None]]
    _log_extra: dict[str, str]
    deployed: DeployedVersion

    if TYPE_CHECKING:

        async def _handle(self, group: list[tuple[Msg, MicroBatch | None]]) -> None: ...

        def _finished(self, task: asyncio.Task[None]) -> None: ...

    async def _on_fast(self, msg: Msg) -> None:
        reply = msg.reply or ""
        batch = None
        if self._free > 0 and not self._stopping.is_set():
            batch = fast_batch(msg.data, self.deployed.config.max_batch_size)
        if batch is None:
            if reply:
                with contextlib.suppress(*NATS_ERRORS):
                    await self._nc.publish(reply, BUSY)
            return
        self._free -= 1
        fake: Msg = FastMsg(self._nc, reply)  # type: ignore[assignment]
        task = asyncio.create_task(self._handle([(fake, batch)]))
        self._inflight.add(task)
        task.add_done_callback(self._finished)
