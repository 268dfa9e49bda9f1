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

from inferbus_common.bus import is_no_responders, leave, sync
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import InferbusError, ResourceExhausted, Unavailable
from inferbus_common.generation import LLM_FULL_REASON
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_headers
from inferbus_common.subjects import Subjects
from inferbus_worker.heartbeat import NATS_ERRORS
from inferbus_worker.llm import metrics

_SYNC_ERRORS: tuple[type[BaseException], ...] = (*NATS_ERRORS, TimeoutError)

log = logging.getLogger(__name__)

QUEUE_GROUP = "llm"
MAX_HANDOFFS = 2
"""Hand-offs of one request before a full worker answers RESOURCE_EXHAUSTED itself.
A request can bounce back to the same worker only while its withdrawal is on its
way to nats-server (one round trip), so two suffice."""


class QueueIntake:
    """Joins and leaves the version's queue group as room comes and goes, and the
    worker's own placement subject as running slots do (a mixin of `VersionServer`,
    which sets the attributes below).

    Two memberships, each a subscription held only while there is room for it:

    * ``queue``: ``ib.gen.<model>.<version>``, queue group ``llm``, while the
      worker holds fewer than `bound` requests (running + waiting);
    * ``direct``: ``ib.gen.<model>.<version>.<worker>``, the router's prefix-aware
      placement (`inferbus_router.prefix`), while fewer than `direct_bound`
      (vLLM's running slots) are held: a request placed for its cached prefix
      never waits behind a full batch here; the router sends it to the queue
      group instead.
    """

    _nc: Client
    _subjects: Subjects
    dv: DeployedVersion
    bound: int
    direct_bound: int
    worker_id: str
    _labels: tuple[str, str]
    _sub: Subscription | None
    _direct_sub: Subscription | None
    _opening: bool
    _direct_opening: bool
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
        """Whether this server is in the queue group now (it has room): nats-server
        routes its requests here (a join counts once `_join` has synced)."""
        return self._sub is not None and not self._opening

    @property
    def taking_placed(self) -> bool:
        """Whether this server takes requests placed on it by prefix now (likewise)."""
        return self._direct_sub is not None and not self._direct_opening

    async def _open_intake(self) -> None:
        """Join the queue group (again) if there is room and we are not in it, and
        the placement subject likewise."""
        await self._join("queue")
        await self._join("direct")

    async def _join(self, which: str) -> None:
        direct = which == "direct"
        if direct and not self.worker_id:
            return
        if self._held(which) is not None or self._joining(which) or self._stopping:
            return
        self._set_joining(which, True)
        m, v = self.dv.model, self.dv.version
        subject = self._subjects.gen_worker(m, v, self.worker_id) if direct else None
        try:
            while (
                self._held(which) is None
                and not self._stopping
                and not self._nc.is_closed
                and self.in_flight < (self.direct_bound if direct else self.bound)
            ):
                try:
                    sub = await self._nc.subscribe(
                        subject or self._subjects.gen(m, v),
                        queue="" if direct else QUEUE_GROUP,
                        cb=self._on_request,
                        pending_msgs_limit=100_000,
                    )
                except NATS_ERRORS as exc:
                    # Reconnecting or closing: nats-py replays live subscriptions on
                    # reconnect, not this one; try again shortly unless stopping.
                    log.warning("could not rejoin the generation %s subject: %s", which, exc)
                    await asyncio.sleep(0.5)
                    continue
                if direct:
                    self._direct_sub = sub
                else:
                    self._sub = sub
                try:
                    # Joined once nats-server routes requests here (`sync`): a request
                    # sent from elsewhere right after finds this member. Meanwhile the
                    # membership is held, so filling up or stopping can leave it.
                    await sync(self._nc, timeout=2)
                except _SYNC_ERRORS as exc:
                    # The subscription stands (nats-py replays it on reconnect).
                    log.debug("generation %s subscription not confirmed: %s", which, exc)
        finally:
            self._set_joining(which, False)
        if self._held(which) is not None:
            # Requests admitted while we subscribed may have filled us meanwhile.
            self._intake_changed()

    def _held(self, which: str) -> Subscription | None:
        return self._direct_sub if which == "direct" else self._sub

    def _joining(self, which: str) -> bool:
        return self._direct_opening if which == "direct" else self._opening

    def _set_joining(self, which: str, value: bool) -> None:
        if which == "direct":
            self._direct_opening = value
        else:
            self._opening = value

    def _close_intake(self) -> None:
        """Leave the queue group and the placement subject (stopping)."""
        self._leave("queue")
        self._leave("direct")

    def _leave(self, which: str) -> None:
        """Leave one membership: the server stops handing us those requests.

        A drain, not an unsubscribe: the requests nats-server already sent us are
        still answered (admitted if a slot freed meanwhile, else handed on).
        """
        sub = self._held(which)
        if sub is None:
            return
        if which == "direct":
            self._direct_sub = None
        else:
            self._sub = None
        task = asyncio.create_task(self._drain(sub), name=f"drain-{which}-{self.dv.model}")
        self._intake_tasks.add(task)
        task.add_done_callback(self._intake_tasks.discard)

    async def _drain(self, sub: Subscription) -> None:
        with contextlib.suppress(*NATS_ERRORS, TimeoutError):
            async with asyncio.timeout(10.0):
                await leave(sub)

    def _intake_changed(self) -> None:
        """Leave a membership at its bound, rejoin it when a slot frees."""
        for which, bound in (("queue", self.bound), ("direct", self.direct_bound)):
            if self.in_flight >= bound:
                self._leave(which)
            elif self._held(which) is None and not self._joining(which) and not self._stopping:
                if which == "direct" and not self.worker_id:
                    continue
                task = asyncio.create_task(self._join(which), name=f"join-{which}-{self.dv.model}")
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
            # To the queue group, also for a request placed on this worker's own subject.
            await self._nc.publish(
                self._subjects.gen(self.dv.model, self.dv.version),
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
