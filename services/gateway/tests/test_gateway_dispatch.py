"""Direct dispatch: requests on plain routes skip the router (real nats-server)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from inferbus_common import headers as h
from inferbus_common.catalog import Route
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import Unavailable
from inferbus_common.subjects import Subjects
from inferbus_gateway.dispatch import Dispatcher, plain_version

SUBJECTS = Subjects("ib")


@pytest.mark.parametrize(
    ("route", "pinned", "expected"),
    [
        (None, "", ""),
        (Route(model="m", stable="3"), "", "3"),
        (Route(model="m", stable="3"), "2", ""),  # pinned: the router resolves it
        (Route(model="m", stable="3", canary="4", canary_weight=10), "", ""),
        (Route(model="m", stable="3", canary="4", canary_weight=0), "", "3"),
        (Route(model="m", stable="3", canary="3", canary_weight=50), "", "3"),
        (Route(model="m", stable="3", shadow="4", shadow_rate=0.5), "", ""),
        (Route(model="m", stable="3", shadow="4", shadow_rate=0.0), "", "3"),
        (Route(model="m", stable="3", canary="4", canary_weight=10, sticky="tenant"), "", ""),
    ],
)
def test_plain_version(route: Route | None, pinned: str, expected: str):
    assert plain_version(route, pinned) == expected


async def _serve(nc, subject: str, seen: list[tuple[str, dict[str, str]]]):
    """Answer every request on `subject` on its Ib-Reply, like a batcher would."""

    async def on_msg(msg) -> None:
        headers = msg.headers or {}
        seen.append((msg.subject, dict(headers)))
        await nc.publish(headers[h.REPLY], b"", headers={h.VERSION: headers.get(h.VERSION, "")})

    sub = await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return sub


async def _call(dispatcher: Dispatcher, route: Route | None, version: str = ""):
    return await dispatcher.call(
        "fraud",
        version=version,
        request_id="r1",
        tensors=[tensor_from_numpy("input", np.zeros((1, 4), np.float32))],
        outputs=[],
        deadline_ns=time.time_ns() + 5_000_000_000,
        route=route,
    )


async def test_direct_dispatch_skips_the_router_only_for_plain_routes(nats_client):
    seen: list[tuple[str, dict[str, str]]] = []
    subs = [
        await _serve(nats_client, SUBJECTS.route("fraud"), seen),
        await _serve(nats_client, SUBJECTS.infer("fraud", "3"), seen),
    ]
    direct = Dispatcher(nats_client, SUBJECTS, "gw-direct", direct=True)
    via_router = Dispatcher(nats_client, SUBJECTS, "gw-router")
    await direct.start()
    await via_router.start()
    try:
        plain = Route(model="fraud", stable="3")
        canary = Route(model="fraud", stable="3", canary="4", canary_weight=20)

        reply = await _call(direct, plain)
        assert reply.headers[h.VERSION] == "3"
        assert seen[-1][0] == SUBJECTS.infer("fraud", "3")
        assert seen[-1][1][h.VERSION] == "3"
        assert seen[-1][1][h.MODEL] == "fraud"

        await _call(direct, canary)  # a canary takes traffic: the router decides
        assert seen[-1][0] == SUBJECTS.route("fraud")
        assert h.VERSION not in seen[-1][1]

        await _call(direct, plain, version="3")  # pinned: the router resolves it
        assert seen[-1][0] == SUBJECTS.route("fraud")
        assert seen[-1][1][h.VERSION] == "3"

        await _call(via_router, plain)  # direct off: always the router
        assert seen[-1][0] == SUBJECTS.route("fraud")
        assert len(seen) == 4
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await direct.stop()
        await via_router.stop()


async def test_direct_dispatch_without_batchers_is_unavailable_at_once(nats_client):
    direct = Dispatcher(nats_client, SUBJECTS, "gw-none", direct=True)
    await direct.start()
    try:
        # nats-server's no-responders answer, not the deadline (DeadlineExceeded).
        with pytest.raises(Unavailable, match="no batcher"):
            await asyncio.wait_for(_call(direct, Route(model="fraud", stable="9")), 10)
    finally:
        await direct.stop()
