"""The router as a real process on a real NATS server."""

from __future__ import annotations

import time

from inferbus_common import headers as h
from inferbus_common.catalog import Route, ensure_kv
from inferbus_common.subjects import Subjects, subject_token


async def _put_route(js, route: Route) -> None:
    kv = await ensure_kv(js, Subjects().routes_bucket)
    await kv.put(Subjects.model_key(route.model), route.model_dump_json().encode())


async def test_forwards_on_headers_and_answers_unknown_models(
    nats_server, nats_client, spawn_service
) -> None:
    await _put_route(
        nats_client.jetstream(),
        Route(model="m.x", stable="1", versions=["1", "2"], aliases={"stable": "1", "canary": "2"}),
    )
    router = await spawn_service(
        "inferbus_router", env={"INFERBUS_ROUTER_NATS_URL": nats_server.url}
    )
    await router.await_ready()
    subjects = Subjects()
    forwarded = await nats_client.subscribe(f"{subjects.prefix}.infer.{subject_token('m.x')}.*")
    replies = await nats_client.subscribe("test.reply.*")
    await nats_client.flush()

    body = b"opaque body the router never reads"
    # The catalog may lag the route put by a moment: retry until forwarded.
    deadline = time.monotonic() + 10
    msg = None
    while msg is None and time.monotonic() < deadline:
        await nats_client.publish(
            subjects.route("m.x"),
            body,
            headers={h.MODEL: "m.x", h.REPLY: "test.reply.1", h.REQUEST_ID: "r1"},
        )
        try:
            msg = await forwarded.next_msg(timeout=0.5)
        except TimeoutError:
            continue
    assert msg is not None, router.log_tail()
    assert msg.subject == subjects.infer("m.x", "1")
    assert msg.data == body
    assert msg.headers[h.VERSION] == "1" and msg.headers[h.REPLY] == "test.reply.1"

    await nats_client.publish(
        subjects.route("m.x"),
        body,
        headers={h.MODEL: "m.x", h.VERSION: "canary", h.REPLY: "test.reply.2"},
    )
    msg = await forwarded.next_msg(timeout=5)
    assert msg.subject == subjects.infer("m.x", "2")

    await nats_client.publish(
        subjects.route("nope"),
        body,
        headers={h.MODEL: "nope", h.REPLY: "test.reply.3", h.REQUEST_ID: "r3"},
    )
    reply = await replies.next_msg(timeout=5)
    assert reply.headers[h.STATUS] == "NOT_FOUND"
    assert "nope" in reply.headers[h.ERROR]
    assert reply.headers[h.REQUEST_ID] == "r3"


async def test_sigterm_exits_promptly_even_when_nats_is_gone(nats_server, spawn_service) -> None:
    router = await spawn_service(
        "inferbus_router",
        env={"INFERBUS_ROUTER_NATS_URL": nats_server.url, "INFERBUS_ROUTER_DRAIN_TIMEOUT_S": "1"},
    )
    await router.await_ready()
    nats_server.kill()
    t0 = time.monotonic()
    code = await router.aterminate(timeout=10)
    assert code == 0, router.log_tail()
    assert time.monotonic() - t0 < 5
