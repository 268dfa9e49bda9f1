"""The router as a real process on a real NATS server."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferbus_common import bus
from inferbus_common.catalog import Route, ensure_kv
from inferbus_common.protocol.bundles import (
    BundledRequest,
    decode_reply_bundle,
    decode_request_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.subjects import Subjects, subject_token
from inferbus_testing.records import ready_heartbeat


async def _put_route(js, route: Route) -> None:
    if route.canary:  # routers send nothing to a canary no worker serves
        workers = await ensure_kv(js, Subjects().workers_bucket)
        await workers.put(*ready_heartbeat(route.model, [route.canary]))
    kv = await ensure_kv(js, Subjects().routes_bucket)
    await kv.put(Subjects.model_key(route.model), route.model_dump_json().encode())


def _bundle(model: str, rid: str, body: bytes = b"", *, pin: str = "", sticky: str = "") -> bytes:
    """One request as a gateway sends it: a request bundle of one (token 1)."""
    env = Envelope(rid, model, time.time_ns() + 60 * 10**9, pin, sticky_key=sticky)
    return encode_request_bundle(model, "", "test.reply.b", [BundledRequest(env, 1)], [(body,)])


async def test_forwards_bundles_and_answers_unknown_models(
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
    replies = await nats_client.subscribe("test.reply.b")
    await bus.sync(nats_client)

    body = b"opaque body the router never reads"
    # The catalog may lag the route put by a moment: retry until forwarded.
    deadline = time.monotonic() + 10
    msg = None
    while msg is None and time.monotonic() < deadline:
        await nats_client.publish(subjects.route("m.x"), _bundle("m.x", "r1", body))
        try:
            msg = await forwarded.next_msg(timeout=0.5)
        except TimeoutError:
            continue
    assert msg is not None, router.log_tail()
    assert msg.subject == subjects.infer("m.x", "1")
    bundle = decode_request_bundle(msg.data)
    assert bytes(bundle.requests[0].frame) == body
    assert bundle.version == "1" and bundle.inbox == "test.reply.b"

    await nats_client.publish(subjects.route("m.x"), _bundle("m.x", "r2", body, pin="canary"))
    msg = await forwarded.next_msg(timeout=5)
    assert msg.subject == subjects.infer("m.x", "2")

    await nats_client.publish(subjects.route("nope"), _bundle("nope", "r3", body))
    reply = decode_reply_bundle((await replies.next_msg(timeout=5)).data).replies[0]
    assert reply.status == "NOT_FOUND"
    assert "nope" in reply.error


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


async def test_sticky_keys_agree_across_router_processes_and_a_restart(
    nats_server, nats_client, spawn_service
) -> None:
    """Separate processes hash with separate ``hash()`` salts: stickiness must not care."""
    await _put_route(
        nats_client.jetstream(),
        Route(
            model="sticky.p",
            stable="1",
            versions=["1", "2"],
            canary="2",
            canary_weight=50.0,
            sticky="header:X-User",
        ),
    )
    env = {"INFERBUS_ROUTER_NATS_URL": nats_server.url, "INFERBUS_ROUTER_METRICS_PORT": "0"}
    subjects = Subjects()
    seen: dict[str, list[str]] = {}

    async def on_forward(msg) -> None:
        bundle = decode_request_bundle(msg.data)
        for r in bundle.requests:
            seen.setdefault(r.envelope.request_id, []).append(bundle.version)

    await nats_client.subscribe(
        f"{subjects.prefix}.infer.{subject_token('sticky.p')}.*", cb=on_forward
    )
    await bus.sync(nats_client)

    async def send(tag: str, keys: int, rounds: int) -> dict[str, set[str]]:
        for r in range(rounds):
            for k in range(keys):
                await nats_client.publish(
                    subjects.route("sticky.p"),
                    _bundle("sticky.p", f"{tag}.{r}.{k}", sticky=f"user-{k}"),
                )
        await bus.sync(nats_client)
        deadline = time.monotonic() + 20
        want = {f"{tag}.{r}.{k}" for r in range(rounds) for k in range(keys)}
        while not want <= seen.keys():
            assert time.monotonic() < deadline, "not every request was forwarded"
            await asyncio.sleep(0.02)
        out: dict[str, set[str]] = {}
        for rid in want:
            out.setdefault(rid.rsplit(".", 1)[1], set()).update(seen[rid])
        return out

    a = await spawn_service("inferbus_router", env=env, name="router-a")
    b = await spawn_service("inferbus_router", env=env, name="router-b")
    await a.await_ready()
    await b.await_ready()
    # A fresh subscription can miss the first message: probe until one is forwarded.
    deadline = time.monotonic() + 10
    while not any(rid.startswith("probe") for rid in seen):
        assert time.monotonic() < deadline, a.log_tail()
        await nats_client.publish(subjects.route("sticky.p"), _bundle("sticky.p", "probe"))
        await asyncio.sleep(0.05)
    before = await send("before", 100, 3)
    # Both instances of the queue group took part.
    for router in (a, b):
        text = httpx.get(f"http://127.0.0.1:{router.ports['metrics']}/metrics").text
        routed = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "inferbus_router_requests_total"
            and sample.labels.get("model") == "sticky.p"
        )
        assert routed > 0
    await b.aterminate(timeout=10)
    b2 = await spawn_service("inferbus_router", env=env, name="router-b2")
    await b2.await_ready()
    await a.aterminate(timeout=10)  # only the restarted instance is left
    after = await send("after", 100, 2)
    assert all(len(v) == 1 for v in before.values()), before
    assert before == after
    assert {v for vs in before.values() for v in vs} == {"1", "2"}
