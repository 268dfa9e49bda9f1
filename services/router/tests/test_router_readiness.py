"""The router's /readyz says ready only once it can take requests: when it first
answers 200, the router's queue subscription on the route subjects is already on
the server (read from nats-server's own monitoring, not inferred from a message,
which a fresh SUB may drop); with NATS gone it answers 503 until NATS is back."""

from __future__ import annotations

import asyncio
import time

import httpx

from inferbus_common.subjects import Subjects
from inferbus_testing.servers import NatsServer


async def _route_subscribers(http: httpx.AsyncClient, server: NatsServer) -> list[str]:
    """Names of the connections subscribed to the route wildcard (queue group included)."""
    connz = (
        await http.get(f"http://127.0.0.1:{server.monitor_port}/connz", params={"subs": "detail"})
    ).json()
    wildcard = Subjects().route_all
    return [
        c.get("name", "")
        for c in connz.get("connections", [])
        if any(s.get("subject") == wildcard for s in c.get("subscriptions_list_detail", []))
    ]


async def _readyz(http: httpx.AsyncClient, url: str) -> tuple[int, str]:
    r = await http.get(url)
    return r.status_code, r.json()["reason"]


async def test_ready_means_subscribed_and_nats_loss_means_not_ready(
    nats_server: NatsServer, spawn_service
) -> None:
    router = await spawn_service(
        "inferbus_router",
        env={
            "INFERBUS_ROUTER_NATS_URL": nats_server.url,
            "INFERBUS_ROUTER_INSTANCE_ID": "router-ready",
        },
    )
    url = router.readyz_url()
    async with httpx.AsyncClient(timeout=2.0) as http:
        assert await _readyz(http, url) == (200, "ok")
        assert "router-ready" in await _route_subscribers(http, nats_server)

        nats_server.stop()
        deadline = time.monotonic() + 15
        while (state := await _readyz(http, url))[0] == 200:
            assert time.monotonic() < deadline, "still ready with NATS down"
            await asyncio.sleep(0.05)
        assert state == (503, "not connected to NATS")

        await asyncio.to_thread(nats_server.start)
        deadline = time.monotonic() + 30
        while (state := await _readyz(http, url))[0] != 200:
            assert time.monotonic() < deadline, f"not ready again: {state}"
            await asyncio.sleep(0.05)
        assert "router-ready" in await _route_subscribers(http, nats_server)
