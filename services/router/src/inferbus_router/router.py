"""The router component: subscribe to `ib.route.*`, forward to `ib.infer.<model>.<version>`."""

from __future__ import annotations

import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter

from inferbus_common import headers as h
from inferbus_common.catalog import Catalog
from inferbus_common.errors import InferbusError, status_of
from inferbus_common.replies import send_error
from inferbus_common.subjects import Subjects, name_from_token
from inferbus_router.routing import choose_version

log = logging.getLogger(__name__)

ROUTED = Counter(
    "inferbus_router_requests_total",
    "Requests handled by the router, by model, chosen version and outcome.",
    ["model", "version", "status"],
)


class Router:
    """Forwards requests to the version the routing table picks.

    Args:
        nc: connected NATS client.
        catalog: live catalog (routes are read from it).
        subjects: naming scheme.
        queue_group: NATS queue group shared by router instances.
    """

    def __init__(self, nc: Client, catalog: Catalog, subjects: Subjects, queue_group: str) -> None:
        self._nc = nc
        self._catalog = catalog
        self._subjects = subjects
        self._queue_group = queue_group
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Start taking requests."""
        self._sub = await self._nc.subscribe(
            self._subjects.route_all,
            queue=self._queue_group,
            cb=self._on_request,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )

    async def drain(self) -> None:
        """Stop taking requests and finish forwarding those already received."""
        if self._sub is not None:
            await self._sub.drain()
            self._sub = None

    async def _on_request(self, msg: Msg) -> None:
        headers = msg.headers or {}
        model = headers.get(h.MODEL) or name_from_token(msg.subject.rsplit(".", 1)[-1])
        reply = headers.get(h.REPLY) or msg.reply or ""
        request_id = headers.get(h.REQUEST_ID, "")
        try:
            route = self._catalog.routes.get(model)
            version = choose_version(route, model, headers.get(h.VERSION, ""))
        except InferbusError as exc:
            code, _ = status_of(exc)
            ROUTED.labels(model, "", code.name).inc()
            await send_error(self._nc, reply, exc, request_id)
            return
        out = dict(headers)
        out[h.VERSION] = version
        out[h.MODEL] = model
        if reply:
            out[h.REPLY] = reply
        await self._nc.publish(self._subjects.infer(model, version), msg.data, headers=out)
        ROUTED.labels(model, version, "OK").inc()
