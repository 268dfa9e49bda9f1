"""The gateway's NATS side: publish a request, wait for its single reply.

Each gateway instance owns one inbox subscription (`ib.reply.<instance>.*`).
A request gets a fresh token; its reply subject is `<inbox>.<token>`. The
first reply for a token resolves the waiting call; later ones (redeliveries
after a worker crash) are counted and dropped.

Requests go to the router (``ib.route.<model>``), which picks the version.
With ``direct`` on (``INFERBUS_GATEWAY_DIRECT_DISPATCH``), a request whose
route leaves nothing to decide (`plain_version`: no pinned version, no
active canary, no shadow) goes straight to the batchers of the stable version
(``ib.infer.<model>.<version>``), saving one NATS hop and the router's work.
"""

from __future__ import annotations

import asyncio
import itertools

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter

from inferbus_common import headers as h
from inferbus_common.catalog import Route
from inferbus_common.codec import Tensor
from inferbus_common.errors import DeadlineExceeded, Unavailable
from inferbus_common.subjects import Subjects
from inferbus_common.wire import encode_tensors

_NATS_STATUS = "Status"
_NO_RESPONDERS = "503"
_NATS_SUBJECT = "Nats-Subject"

DUPLICATE_REPLIES = Counter(
    "inferbus_gateway_duplicate_replies_total",
    "Replies dropped because the request was already answered (or given up).",
)


def plain_version(route: Route | None, pinned: str) -> str:
    """The version the router would pick for a request with nothing to decide, else ''.

    Nothing to decide: the client pinned no version, the route has no canary
    taking traffic (so stickiness and health weights do not matter) and no
    shadow copy to send. Then the router's answer is always ``route.stable``
    (`inferbus_router.routing.decide`), and the gateway can publish there itself.
    """
    if route is None or pinned or not route.stable:
        return ""
    if route.canary and route.canary != route.stable and route.canary_weight > 0:
        return ""
    if route.shadow and route.shadow_rate > 0:
        return ""
    return route.stable


def _expire(fut: asyncio.Future[Msg]) -> None:
    """The deadline passed before the reply: wake the caller with a timeout."""
    if not fut.done():
        fut.set_exception(TimeoutError())


class Dispatcher:
    """Sends requests into the platform and matches replies to callers.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        instance: this gateway's unique id (names its inbox).
        direct: publish requests on plain routes (`plain_version`) straight to
            the stable version's batchers instead of through the router.
    """

    def __init__(
        self, nc: Client, subjects: Subjects, instance: str, *, direct: bool = False
    ) -> None:
        self._direct = direct
        self._nc = nc
        self._subjects = subjects
        self._inbox = subjects.reply_inbox(instance)
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count(1)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Subscribe to this instance's inbox."""
        self._sub = await self._nc.subscribe(
            f"{self._inbox}.*",
            cb=self._on_reply,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )

    async def stop(self) -> None:
        """Unsubscribe; callers still waiting get UNAVAILABLE."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(Unavailable("gateway is shutting down"))
        self._pending.clear()

    @property
    def in_flight(self) -> int:
        """Requests waiting for their reply."""
        return len(self._pending)

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject[len(self._inbox) + 1 :]
        fut = self._pending.pop(token, None)
        if fut is None or fut.done():
            DUPLICATE_REPLIES.inc()
            return
        if not msg.data and (msg.headers or {}).get(_NATS_STATUS) == _NO_RESPONDERS:
            # nats-server's own answer: nobody subscribes to the route subject
            # (every router is down or restarting), or, for a direct request,
            # to the version's subject (no batcher). Nothing was computed: say
            # so now instead of waiting out the deadline.
            fut.set_exception(
                Unavailable(
                    "no batcher is serving this model version right now (restarting?); "
                    "nothing was computed, safe to retry"
                    if ".infer." in (msg.headers or {}).get(_NATS_SUBJECT, "")
                    else "no router is serving requests right now (restarting?); "
                    "nothing was computed, safe to retry"
                )
            )
            return
        fut.set_result(msg)

    async def call(
        self,
        model: str,
        *,
        version: str,
        request_id: str,
        tensors: list[Tensor],
        outputs: list[str],
        deadline_ns: int,
        priority: int = 0,
        traceparent: str = "",
        tenant: str = "",
        sticky_key: str = "",
        route: Route | None = None,
    ) -> Msg:
        """Publish a request and wait for its reply until `deadline_ns`.

        `route` is the model's routing table as the gateway knows it; with
        ``direct`` on and a plain route the request skips the router.

        Raises:
            DeadlineExceeded: no reply before the deadline.
        """
        token = str(next(self._tokens))
        reply = f"{self._inbox}.{token}"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = fut
        headers = {
            h.REQUEST_ID: request_id,
            h.DEADLINE: str(deadline_ns),
            h.MODEL: model,
            h.REPLY: reply,
        }
        subject = ""
        if self._direct:
            direct_version = plain_version(route, version)
            if direct_version:
                version = direct_version
                subject = self._subjects.infer(model, direct_version)
        if version:
            headers[h.VERSION] = version
        if outputs:
            headers[h.OUTPUTS] = ",".join(outputs)
        if priority:
            headers[h.PRIORITY] = str(priority)
        if traceparent:
            headers[h.TRACEPARENT] = traceparent
        if tenant:
            headers[h.TENANT] = tenant
        if sticky_key:
            headers[h.STICKY_KEY] = sticky_key
        try:
            await self._nc.publish(
                subject or self._subjects.route(model),
                encode_tensors(tensors),
                reply=reply,
                headers=headers,
            )
            remaining = h.remaining_s(deadline_ns)
            if remaining <= 0:
                raise TimeoutError
            # A timer on the reply's own future instead of `asyncio.wait_for`: the
            # same deadline without wait_for's extra waiter future and loop hop
            # (about 1.7 µs of CPU per request, `bench/hotpath_micro.py`).
            timer = loop.call_later(remaining, _expire, fut)
            try:
                return await fut
            finally:
                timer.cancel()
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {request_id} for model '{model}' got no answer before its deadline"
            ) from None
        finally:
            self._pending.pop(token, None)
