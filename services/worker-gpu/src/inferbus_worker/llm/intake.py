"""Bounded intake of one generative version: a member of the ``llm`` queue group only
while it has room, and a hand-off of what still reaches it when full. See
docs/architecture.md ("The generative path", 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common.bus import is_no_responders
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import InferbusError, ResourceExhausted, Unavailable
from inferbus_common.generation import LLM_FULL_REASON
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_headers
from inferbus_common.subjects import Subjects
from inferbus_worker.heartbeat import NATS_ERRORS
from inferbus_worker.llm import metrics

log = logging.getLogger(__name__)

QUEUE_GROUP = "llm"
MAX_HANDOFFS = 2
"""Hand-offs of one request before a full worker answers RESOURCE_EXHAUSTED itself.
A request can bounce back to the same worker only while its withdrawal is on its
way to nats-server (one round trip), so two suffice."""


class QueueIntake:
    """Joins and leaves the version's queue group as room comes and goes (a mixin of
    `VersionServer`, which sets the attributes below)."""

    _nc: Client
    _subjects: Subjects
    dv: DeployedVersion
    bound: int
    _labels: tuple[str, str]
    _sub: Subscription | None
    _opening: bool
    _stopping: bool
    _intake_tasks: set[asyncio.Task[None]]
    _handoff_inbox: str
    _on_request: Callable[[Msg], Awaitable[None]]

    @property
    def in_flight(self) -> int:
        """Requests held (running + waiting in the engine)."""
        raise NotImplementedError

    @property
    def taking_requests(self) -> bool:
        """Whether this server is in the queue group now (it has room)."""
        return self._sub is not None

    async def _open_intake(self) -> None:
        """Join the queue group (again) if there is room and we are not in it."""
        if self._sub is not None or self._opening or self._stopping:
            return
        self._opening = True
        try:
            while (
                self._sub is None
                and not self._stopping
                and not self._nc.is_closed
                and self.in_flight < self.bound
            ):
                try:
                    self._sub = await self._nc.subscribe(
                        self._subjects.gen(self.dv.model, self.dv.version),
                        queue=QUEUE_GROUP,
                        cb=self._on_request,
                        pending_msgs_limit=100_000,
                    )
                except NATS_ERRORS as exc:
                    # Reconnecting or closing: nats-py replays live subscriptions on
                    # reconnect, not this one; try again shortly unless stopping.
                    log.warning("could not rejoin the generation queue group: %s", exc)
                    await asyncio.sleep(0.5)
        finally:
            self._opening = False

    def _close_intake(self) -> None:
        """Leave the queue group at the bound: the server stops handing us requests.

        A drain, not an unsubscribe: the requests nats-server already sent us are
        still answered (admitted if a slot freed meanwhile, else handed on).
        """
        sub, self._sub = self._sub, None
        if sub is None:
            return
        task = asyncio.create_task(self._drain(sub), name=f"drain-{self.dv.model}")
        self._intake_tasks.add(task)
        task.add_done_callback(self._intake_tasks.discard)

    async def _drain(self, sub: Subscription) -> None:
        with contextlib.suppress(*NATS_ERRORS, TimeoutError):
            async with asyncio.timeout(10.0):
                await sub.drain()

    def _intake_changed(self) -> None:
        """Leave the queue group when full, rejoin it when a slot frees."""
        if self.in_flight >= self.bound:
            self._close_intake()
        elif self._sub is None and not self._opening and not self._stopping:
            task = asyncio.create_task(self._open_intake(), name=f"intake-{self.dv.model}")
            self._intake_tasks.add(task)
            task.add_done_callback(self._intake_tasks.discard)

    async def _hand_off(self, msg: Msg, headers: dict[str, str]) -> bool:
        """Publish a request this server cannot take back to its subject, for another worker.

        The copy's NATS reply subject is this server's hand-off inbox: if no worker
        with room is subscribed, nats-server's "no responders" comes back here and
        `_on_handoff_refused` answers the client. After `MAX_HANDOFFS`, or without
        an ``Ib-Reply`` to answer, the caller answers the request itself.
        """
        try:
            hops = int(headers.get(h.HANDOFF) or 0)
        except ValueError:
            hops = MAX_HANDOFFS
        client_reply = headers.get(h.REPLY, "")
        if not client_reply or hops >= MAX_HANDOFFS or not self._handoff_inbox:
            return False
        # Let a withdrawal started by the request that filled us reach the socket
        # first, so the copy is not sent back to us (same connection, in order).
        await asyncio.sleep(0)
        why = "s" if self._stopping else "f"
        forwarded = {**headers, h.HANDOFF: str(hops + 1)}
        try:
            await self._nc.publish(
                msg.subject,
                msg.data,
                reply=f"{self._handoff_inbox}.{why}.{client_reply}",
                headers=forwarded,
            )
        except NATS_ERRORS:
            return False
        metrics.HANDED_OFF.labels(*self._labels).inc()
        return True

    async def _on_handoff_refused(self, msg: Msg) -> None:
        """No worker took a request we handed off: answer its client now (429, or
        503 when we handed it off because we are stopping)."""
        if not is_no_responders(msg):
            return
        why, _, reply = msg.subject[len(self._handoff_inbox) + 1 :].partition(".")
        where = f"model '{self.dv.model}' version '{self.dv.version}'"
        exc: InferbusError
        if why == "s":
            exc = Unavailable(
                f"the worker serving {where} is stopping and no other worker has room; "
                "nothing was generated, retry"
            )
        else:
            metrics.REJECTED.labels(*self._labels).inc()
            exc = ResourceExhausted(
                f"{where}: every worker serving it holds as many requests as it admits "
                f"(bound {self.bound} here); nothing was generated, retry later",
                reason=LLM_FULL_REASON,
                retry_after_s=1.0,
            )
        metrics.REQUESTS.labels(*self._labels, exc.code.name).inc()
        with contextlib.suppress(*NATS_ERRORS):
            await self._nc.publish(reply, b"", headers={**error_headers(exc), h.FINAL: "1"})
