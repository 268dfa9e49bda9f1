"""The Router object on a real nats-server: split accuracy, stickiness across
instances and restarts, shadow copies, health-scaled weights, route revisions.

No workers: the tests watch (and, for shadow, answer) the subjects the router
publishes to, ``ib.infer.<model>.*``, as batchers and workers would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import nats
import numpy as np
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.catalog import Catalog, Route, WorkerStatus, ensure_kv
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import (
    BundledReply,
    BundledRequest,
    RequestBundle,
    decode_reply_bundle,
    decode_request_bundle,
    encode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.tensors import decode_tensors, encode_tensors
from inferbus_common.resolver import STICKY_BUCKETS, sticky_bucket
from inferbus_common.subjects import Subjects, subject_token
from inferbus_router.health import HealthPolicy, HealthWeights
from inferbus_router.router import Router
from inferbus_router.shadow import ShadowComparer
from inferbus_testing.busdebug import lost_request_report
from inferbus_testing.records import audit_record, ready_heartbeat

SUBJECTS = Subjects()


async def put_route(js, route: Route) -> None:
    """Write a routing table straight into the routes KV bucket, and a worker heartbeat
    that reports its canary and shadow ready (routers send nothing to a version no
    worker serves)."""
    named = [v for v in (route.canary, route.shadow) if v]
    if named:
        workers = await ensure_kv(js, SUBJECTS.workers_bucket)
        await workers.put(*ready_heartbeat(route.model, named))
    kv = await ensure_kv(js, SUBJECTS.routes_bucket)
    await kv.put(Subjects.model_key(route.model), route.model_dump_json().encode())


@contextlib.asynccontextmanager
async def running_router(
    url: str,
    instance: str,
    *,
    health: HealthWeights | None = None,
    shadow_timeout_s: float = 5.0,
    errors: list[BaseException] | None = None,
) -> AsyncIterator[tuple[Router, Catalog, ShadowComparer]]:
    """A Router with its own connection and catalog, as `python -m inferbus_router` builds it.

    `errors` collects what the connection reports (an exception a callback raised
    included), for failure messages."""
    seen = errors if errors is not None else []

    async def on_error(exc: BaseException) -> None:
        seen.append(exc)
        logging.getLogger(__name__).error("router connection error: %r", exc, exc_info=exc)

    nc = await nats.connect(url, name=instance, error_cb=on_error)
    try:
        async with Catalog(nc.jetstream(), SUBJECTS) as catalog:
            await catalog.wait_loaded()
            comparer = ShadowComparer(nc, SUBJECTS, instance, timeout_s=shadow_timeout_s)
            router = Router(
                nc,
                catalog,
                SUBJECTS,
                "router",
                health=health,
                shadow=comparer,
                health_interval_s=0.05,
            )
            await router.start()
            try:
                yield router, catalog, comparer
            finally:
                await router.drain()
    finally:
        await nc.close()


async def wait_route(catalog: Catalog, route: Route) -> None:
    def seen() -> bool:
        named = [v for v in (route.canary, route.shadow) if v]
        return catalog.routes.get(route.model) == route and all(
            catalog.is_ready(route.model, v) for v in named
        )

    assert await catalog.wait_for(seen, 10)


async def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@dataclass
class Seen:
    """One request as the router forwarded it (in a bundle to a version's subject)."""

    subject: str
    version: str
    inbox: str
    request: BundledRequest


_tokens = iter(range(1, 1 << 62))


async def send_request(
    nc: Client,
    model: str,
    request_id: str,
    frame: bytes = b"",
    *,
    inbox: str = "test.reply.b",
    tenant: str = "",
    pin: str = "",
    token: int = 0,
) -> None:
    """One request as a gateway sends it: a request bundle of one."""
    env = Envelope(request_id, model, time.time_ns() + 60 * 10**9, pin, tenant=tenant)
    request = BundledRequest(env, token or next(_tokens))
    await nc.publish(
        SUBJECTS.route(model), encode_request_bundle(model, "", inbox, [request], [(frame,)])
    )


class Forwarded:
    """Collects what the router forwarded for one model (a batcher's view)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.by_request: dict[str, Seen] = {}
        self.probes = 0

    async def subscribe(self, nc: Client) -> None:
        await nc.subscribe(f"{SUBJECTS.prefix}.infer.{subject_token(self.model)}.*", cb=self._on)
        await bus.sync(nc)

    async def _on(self, msg: Msg) -> None:
        bundle = decode_request_bundle(msg.data)
        for r in bundle.requests:
            rid = r.envelope.request_id
            if rid.startswith("probe-"):
                self.probes += 1
            else:
                self.by_request[rid] = Seen(msg.subject, bundle.version, bundle.inbox, r)

    async def probe(self, nc: Client) -> None:
        """Send pinned probes until one comes through (a fresh SUB can miss the first)."""
        k = 0
        deadline = time.monotonic() + 10
        while self.probes == 0:
            assert time.monotonic() < deadline, "router forwards nothing"
            await send_request(nc, self.model, f"probe-{k}", pin="stable")
            k += 1
            await asyncio.sleep(0.02)


def version_of(seen: Seen) -> str:
    return seen.version


async def test_canary_share_over_10000_requests(nats_server, nats_client) -> None:
    route = Route(model="split", stable="1", versions=["1", "2"], canary="2", canary_weight=10.0)
    await put_route(nats_client.jetstream(), route)
    async with running_router(nats_server.url, "r-split") as (_, catalog, _):
        await wait_route(catalog, route)
        seen = Forwarded("split")
        await seen.subscribe(nats_client)
        await seen.probe(nats_client)
        n = 10_000
        for i in range(n):
            await send_request(nats_client, "split", f"r{i}", b"x")
            if i % 1000 == 999:
                await bus.sync(nats_client)
        await wait_until(lambda: len(seen.by_request) == n)
    versions = Counter(version_of(m) for m in seen.by_request.values())
    share = versions["2"] / n
    print(f"canary share over {n} requests at weight 10%: {share:.4f} ({dict(versions)})")
    assert set(versions) == {"1", "2"}
    assert abs(share - 0.10) <= 0.015
    # Forwarded unchanged apart from the decision.
    fwd = seen.by_request["r0"]
    assert bytes(fwd.request.frame) == b"x" and fwd.inbox == "test.reply.b"
    assert fwd.subject == SUBJECTS.infer("split", version_of(fwd))


async def test_sticky_keys_agree_across_instances_and_a_restart(nats_server, nats_client) -> None:
    route = Route(
        model="sticky",
        stable="1",
        versions=["1", "2"],
        canary="2",
        canary_weight=30.0,
        sticky="tenant",
    )
    await put_route(nats_client.jetstream(), route)
    keys = [f"tenant-{i}" for i in range(300)]
    seen = Forwarded("sticky")
    await seen.subscribe(nats_client)

    async def send(tag: str, rounds: int) -> None:
        for r in range(rounds):
            for k in keys:
                await send_request(nats_client, "sticky", f"{tag}-{r}-{k}", tenant=k)
        await bus.sync(nats_client)

    def mapping(tag: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for rid, msg in seen.by_request.items():
            if rid.startswith(f"{tag}-"):
                out[msg.request.envelope.tenant].add(version_of(msg))
        return out

    async with running_router(nats_server.url, "r-a") as (router_a, cat_a, _):
        async with running_router(nats_server.url, "r-b") as (router_b, cat_b, _):
            await wait_route(cat_a, route)
            await wait_route(cat_b, route)
            await seen.probe(nats_client)
            await send("before", 4)
            await wait_until(lambda: len(seen.by_request) == 4 * len(keys))
            # Both instances of the queue group took part.
            assert router_a._sub is not None and router_b._sub is not None
            assert router_a._sub.delivered > 0 and router_b._sub.delivered > 0
        # Instance B is gone; a new one (fresh process state) joins the group.
        async with running_router(nats_server.url, "r-b2") as (_, cat_b2, _):
            await wait_route(cat_b2, route)
            await send("after", 2)
            await wait_until(lambda: len(seen.by_request) == 6 * len(keys))
    before, after = mapping("before"), mapping("after")
    assert all(len(v) == 1 for v in before.values()), before
    assert all(len(v) == 1 for v in after.values()), after
    assert before == after
    on_canary = sum(v == {"2"} for v in before.values()) / len(keys)
    assert 0.2 < on_canary < 0.4


def _probabilities(frame: bytes) -> np.ndarray:
    x = decode_tensors(frame)[0].as_numpy()
    return np.stack([x[:, 0], 1 - x[:, 0]], axis=1).astype(np.float32)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_shadow_copies_are_compared_and_never_reach_the_client(
    nats_server, nats_client
) -> None:
    model = "shadowed"
    route = Route(model=model, stable="1", versions=["1", "2"], shadow="2", shadow_rate=0.5)
    await put_route(nats_client.jetstream(), route)
    labels = {"model": model, "primary": "1", "shadow": "2"}
    shadow_mode = {"answer": "flip-every-4th"}

    async def worker(msg: Msg) -> None:
        """Plays batcher+worker: answers each copy, mirrors like the real worker."""
        bundle = decode_request_bundle(msg.data)
        version = bundle.version
        for r in bundle.requests:
            rid = r.envelope.request_id
            if rid.startswith("probe-"):
                continue
            probs = _probabilities(bytes(r.frame))
            if version == "2":
                if shadow_mode["answer"] == "silent":
                    continue
                if shadow_mode["answer"] == "error":
                    reply = BundledReply(r.token, "INTERNAL", "shadow failed")
                    await nats_client.publish(
                        bundle.inbox, encode_reply_bundle(version, "", "", 1, [reply], [()])
                    )
                    continue
                if int(rid[1:]) % 4 == 0:
                    probs = probs[:, ::-1].copy()
            body = encode_tensors([tensor_from_numpy("probabilities", probs)])
            await nats_client.publish(
                bundle.inbox,
                encode_reply_bundle(version, "", "", 1, [BundledReply(r.token)], [(body,)]),
            )
            if r.mirror:
                await nats_client.publish(
                    r.mirror,
                    encode_reply_bundle(
                        version, "", "", 1, [BundledReply(r.mirror_token)], [(body,)]
                    ),
                )

    client_replies: list[tuple[str, BundledReply]] = []

    async def on_client_reply(msg: Msg) -> None:
        bundle = decode_reply_bundle(msg.data)
        client_replies.extend((bundle.version, r) for r in bundle.replies)

    seen = Forwarded(model)
    await seen.subscribe(nats_client)
    await nats_client.subscribe(f"{SUBJECTS.prefix}.infer.{subject_token(model)}.*", cb=worker)
    await nats_client.subscribe("client.reply.b", cb=on_client_reply)
    await bus.sync(nats_client)

    async def send(start: int, n: int) -> None:
        for i in range(start, start + n):
            body = encode_tensors(
                [tensor_from_numpy("input", np.array([[0.9 if i % 2 else 0.1]], np.float32))]
            )
            await send_request(
                nats_client, model, f"r{i}", body, inbox="client.reply.b", token=i + 1
            )
        await bus.sync(nats_client)

    async with running_router(nats_server.url, "r-shadow", shadow_timeout_s=1.0) as (
        _,
        catalog,
        comparer,
    ):
        await wait_route(catalog, route)
        await seen.probe(nats_client)
        n = 800
        await send(0, n)
        await wait_until(lambda: len(client_replies) == n)
        await wait_until(lambda: comparer.pending == 0)
        compared = _sample("inferbus_shadow_requests_total", **labels, outcome="compared")
        shadow_copies = sum(1 for m in seen.by_request.values() if version_of(m) == "2")
        assert compared == shadow_copies
        assert 0.4 * n < compared < 0.6 * n
        agree = _sample("inferbus_shadow_rows_total", **labels, result="agree")
        disagree = _sample("inferbus_shadow_rows_total", **labels, result="disagree")
        assert agree + disagree == compared
        ratio = _sample("inferbus_shadow_agreement_ratio", **labels)
        sampled = [rid for rid, m in seen.by_request.items() if version_of(m) == "2"]
        flipped = sum(int(rid[1:]) % 4 == 0 for rid in sampled)
        print(f"shadow agreement {ratio:.3f} over {compared:.0f} compared (expected ~0.75)")
        assert (agree, disagree) == (len(sampled) - flipped, flipped)
        assert ratio == pytest.approx(1 - flipped / len(sampled))
        # Every client got exactly its primary's answer, never a shadow one.
        assert all(version == "1" for version, _ in client_replies)
        assert len({r.token for _, r in client_replies}) == n

        # A failing shadow (errors, then silence) is counted and never felt.
        shadow_mode["answer"] = "error"
        await send(n, 200)
        await wait_until(lambda: len(client_replies) == n + 200)
        await wait_until(lambda: comparer.pending == 0)
        errors = _sample("inferbus_shadow_requests_total", **labels, outcome="shadow_error")
        assert errors > 50
        shadow_mode["answer"] = "silent"
        await send(n + 200, 200)
        await wait_until(lambda: len(client_replies) == n + 400)
        await wait_until(lambda: comparer.pending == 0, timeout=10)
        timeouts = _sample("inferbus_shadow_requests_total", **labels, outcome="shadow_timeout")
        assert timeouts > 50
        assert all(r.status == "" for _, r in client_replies)


def _audit(model: str, version: str, status: str, request_id: str) -> bytes:
    return audit_record(model, version, status, request_id=request_id, latency_ms=2.0)


async def test_unhealthy_canary_gets_less_traffic(nats_server, nats_client) -> None:
    model = "healthy"
    route = Route(model=model, stable="1", versions=["1", "2"], canary="2", canary_weight=50.0)
    await put_route(nats_client.jetstream(), route)
    health = HealthWeights(HealthPolicy(window_s=60, min_samples=20, floor=0.1, decrease=0.5))
    async with running_router(nats_server.url, "r-health", health=health) as (_, catalog, _):
        await wait_route(catalog, route)
        # Until the router sees audit records (nats-server can miss messages sent just
        # after another connection's SUB): OK records of stable, harmless to the verdict.
        deadline = time.monotonic() + 10
        while health.stats(model, "1")[0] == 0:
            assert time.monotonic() < deadline, "the router receives no audit records"
            await nats_client.publish(SUBJECTS.audit(model), _audit(model, "1", "OK", "probe"))
            await asyncio.sleep(0.02)
        for i in range(200):
            for version, status in (("1", "OK"), ("2", "INTERNAL" if i % 2 else "OK")):
                await nats_client.publish(
                    SUBJECTS.audit(model), _audit(model, version, status, f"a{i}")
                )
        await bus.sync(nats_client)
        await wait_until(lambda: health.factor(model, "2") == 0.1, timeout=20)
        gauge = REGISTRY.get_sample_value(
            "inferbus_router_effective_weight", {"model": model, "version": "2"}
        )
        assert gauge == 5.0
        # The route itself is untouched: the router scales, never writes.
        assert catalog.routes[model].canary_weight == 50.0
        seen = Forwarded(model)
        await seen.subscribe(nats_client)
        await seen.probe(nats_client)
        n = 2000
        for i in range(n):
            await send_request(nats_client, model, f"r{i}")
        await bus.sync(nats_client)
        await wait_until(lambda: len(seen.by_request) == n)
    share = sum(version_of(m) == "2" for m in seen.by_request.values()) / n
    print(f"canary share with health factor 0.1 on weight 50: {share:.3f}")
    assert 0.02 < share < 0.09


async def test_route_revisions_are_exported_and_logged_once(
    nats_server, nats_client, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_router.router")
    route = Route(model="revs", stable="1", versions=["1"], revision=1, updated_by="alice")
    await put_route(nats_client.jetstream(), route)
    async with running_router(nats_server.url, "r-revs") as (_, catalog, _):
        await wait_route(catalog, route)
        newer = route.model_copy(
            update={"revision": 2, "updated_by": "rollout", "change": "step 25%"}
        )
        await put_route(nats_client.jetstream(), newer)
        await wait_route(catalog, newer)

        def gauge() -> float | None:
            return REGISTRY.get_sample_value("inferbus_router_route_revision", {"model": "revs"})

        await wait_until(lambda: gauge() == 2.0, timeout=10)
        # The same revision written again (e.g. by a second registry) is not news.
        await put_route(nats_client.jetstream(), newer)
        await asyncio.sleep(0.3)
    logged = [r for r in caplog.records if r.getMessage().startswith("route revision")]
    assert [(r.revision, r.updated_by, r.change) for r in logged] == [
        (1, "alice", ""),
        (2, "rollout", "step 25%"),
    ]


async def test_generate_requests_go_to_the_gen_subject_by_the_same_rules(
    nats_server, nats_client
) -> None:
    route = Route(
        model="llm",
        stable="1",
        versions=["1", "2"],
        canary="2",
        canary_weight=100.0,
        shadow="1",
        shadow_rate=1.0,
    )
    await put_route(nats_client.jetstream(), route)
    got: list[Msg] = []

    async def on_gen(msg: Msg) -> None:
        got.append(msg)

    await nats_client.subscribe(f"{SUBJECTS.prefix}.gen.{subject_token('llm')}.*", cb=on_gen)
    infer = await nats_client.subscribe(f"{SUBJECTS.prefix}.infer.{subject_token('llm')}.*")
    await bus.sync(nats_client)
    async with running_router(nats_server.url, "r-gen") as (_, catalog, comparer):
        await wait_route(catalog, route)
        deadline = time.monotonic() + 10
        while not got:
            assert time.monotonic() < deadline
            await nats_client.publish(
                SUBJECTS.gen_route("llm"),
                b"{}",
                headers={h.MODEL: "llm", h.KIND: h.KIND_GENERATE, h.REQUEST_ID: "g"},
            )
            await asyncio.sleep(0.05)
        # Streams are never shadowed.
        assert comparer.pending == 0
    assert got[0].subject == SUBJECTS.gen("llm", "2")
    assert infer.pending_msgs == 0


async def test_generate_request_nobody_takes_is_answered_429_or_503(
    nats_server, nats_client
) -> None:
    """LLM workers leave their queue group while full: with no subscriber the router
    answers at once, 429 when the version's workers report ready (all full), else 503."""
    route = Route(model="llm-full", stable="1", versions=["1"])
    js = nats_client.jetstream()
    await put_route(js, route)
    workers = await ensure_kv(js, SUBJECTS.workers_bucket)
    answers: asyncio.Queue[Msg] = asyncio.Queue()
    inbox = nats_client.new_inbox()
    await nats_client.subscribe(inbox, cb=answers.put)
    await bus.sync(nats_client)

    async def ask(rid: str) -> dict[str, str]:
        await nats_client.publish(
            SUBJECTS.gen_route("llm-full"),
            b"{}",
            headers={
                h.MODEL: "llm-full",
                h.KIND: h.KIND_GENERATE,
                h.REQUEST_ID: rid,
                h.REPLY: inbox,
            },
        )
        try:
            msg = await asyncio.wait_for(answers.get(), 10)
        except TimeoutError:
            raise AssertionError(
                f"{rid}: no answer in 10 s; router errors {errors}; "
                f"{lost_request_report(nats_server, SUBJECTS.gen_route('llm-full'), router)}"
            ) from None
        return msg.headers or {}

    errors: list[BaseException] = []
    async with running_router(nats_server.url, "r-gen-full", errors=errors) as (
        router,
        catalog,
        _comparer,
    ):
        await wait_route(catalog, route)
        # No worker at all: 503, and the message names the state.
        got = await ask("none")
        assert got[h.STATUS] == "UNAVAILABLE", got
        assert "no worker is taking generation requests" in got[h.ERROR]
        assert "no worker" in got[h.ERROR]

        status = WorkerStatus(
            worker_id="w1",
            pool="default",
            models={"llm-full/1": "ready"},
            ts_ms=int(time.time() * 1000),
        )
        await workers.put("w1", status.model_dump_json().encode())
        assert await catalog.wait_for(lambda: bool(catalog.ready_workers("llm-full", "1")), 10)
        # A ready worker that is not subscribed: it is full. 429, at once.
        t0 = time.monotonic()
        got = await ask("full")
        print(f"429 after {(time.monotonic() - t0) * 1000:.1f} ms")
        assert got[h.STATUS] == "RESOURCE_EXHAUSTED", got
        assert got[h.REASON] == "llm-full"
        assert "all 1 worker(s) serving it" in got[h.ERROR]
        assert answers.empty()


async def test_a_bundle_is_split_by_version_with_its_shadow_copies(
    nats_server, nats_client
) -> None:
    route = Route(
        model="bun",
        stable="1",
        versions=["1", "2", "3"],
        canary="2",
        canary_weight=50.0,
        sticky="tenant",
        shadow="3",
        shadow_rate=1.0,
    )
    await put_route(nats_client.jetstream(), route)
    forwarded: list[tuple[str, RequestBundle]] = []
    got_reply = asyncio.Event()
    replies: list[BundledReply] = []

    probes: list[Msg] = []

    async def on_forward(msg: Msg) -> None:
        bundle = decode_request_bundle(msg.data)
        if bundle.requests[0].envelope.request_id.startswith("probe-"):
            probes.append(msg)
        else:
            forwarded.append((msg.subject, bundle))

    async def on_reply(msg: Msg) -> None:
        replies.extend(decode_reply_bundle(msg.data).replies)
        got_reply.set()

    await nats_client.subscribe(f"{SUBJECTS.prefix}.infer.bun.*", cb=on_forward)
    await nats_client.subscribe("gwtest.b", cb=on_reply)
    await bus.sync(nats_client)
    x = encode_tensors([tensor_from_numpy("input", np.ones((1, 2), np.float32))])
    tenants = [f"t{i}" for i in range(8)]
    deadline = time.time_ns() + 10**10
    requests = [
        BundledRequest(Envelope(f"r{i}", "bun", deadline, tenant=t), i + 1)
        for i, t in enumerate(tenants)
    ]
    requests.append(BundledRequest(Envelope("pinned", "bun", deadline, "1"), 50))
    requests.append(BundledRequest(Envelope("unknown", "bun", deadline, "9"), 51))
    async with running_router(nats_server.url, "r-bundle") as (_, catalog, comparer):
        await wait_route(catalog, route)
        await _probe_until(nats_client, "bun", lambda: bool(probes))
        await nats_client.publish(
            SUBJECTS.route("bun"),
            encode_request_bundle("bun", "", "gwtest.b", requests, [(x,)] * len(requests)),
        )
        await wait_until(lambda: len(forwarded) >= 3 and got_reply.is_set(), 10)
        primaries = {b.version: b for _, b in forwarded if b.inbox == "gwtest.b"}
        shadow = [b for _, b in forwarded if b.inbox != "gwtest.b"]
        # Sticky by tenant: the same split any router computes for these keys.
        want = {"1": [50], "2": []}
        for r in requests[:8]:
            hit = sticky_bucket("bun", r.envelope.tenant) < 50.0 * (STICKY_BUCKETS / 100)
            want["2" if hit else "1"].append(r.token)
        assert {v: sorted(r.token for r in b.requests) for v, b in primaries.items()} == {
            v: sorted(t) for v, t in want.items() if t
        }
        assert all(bytes(r.frame) == x for b in primaries.values() for r in b.requests)
        # Every primary has a shadow copy in one bundle to version 3, paired by token.
        (copy,) = shadow
        assert copy.version == "3" and copy.inbox == f"{comparer.inbox}.sb"
        mirrors = {r.mirror_token: r for b in primaries.values() for r in b.requests}
        assert sorted(r.token for r in copy.requests) == sorted(mirrors)
        assert all(r.mirror == f"{comparer.inbox}.pb" for r in mirrors.values())
        # The unknown pin is answered by the router itself, in a reply bundle.
        assert [(r.token, r.status) for r in replies] == [(51, "NOT_FOUND")]
        # Answer both sides of every pair: the comparer pairs them from reply bundles.
        compared = (
            REGISTRY.get_sample_value(
                "inferbus_shadow_requests_total",
                {"model": "bun", "primary": "1", "shadow": "3", "outcome": "compared"},
            )
            or 0.0
        )
        pairs = [r.mirror_token for r in primaries["1"].requests]
        out = encode_tensors([tensor_from_numpy("y", np.array([[0.2, 0.8]], np.float32))])
        for inbox in (f"{comparer.inbox}.pb", f"{comparer.inbox}.sb"):
            await nats_client.publish(
                inbox,
                encode_reply_bundle(
                    "1", "d", "", 1, [BundledReply(t) for t in pairs], [(out,)] * len(pairs)
                ),
            )
        await wait_until(
            lambda: (
                (
                    REGISTRY.get_sample_value(
                        "inferbus_shadow_requests_total",
                        {"model": "bun", "primary": "1", "shadow": "3", "outcome": "compared"},
                    )
                    or 0.0
                )
                == compared + len(pairs)
            ),
            10,
        )


async def test_a_bundle_nobody_takes_is_answered_unavailable_at_once(
    nats_server, nats_client
) -> None:
    route = Route(model="lonely", stable="1", versions=["1"])
    await put_route(nats_client.jetstream(), route)
    replies: list[BundledReply] = []

    async def on_reply(msg: Msg) -> None:
        if msg.subject == "gwlonely.b":
            replies.extend(decode_reply_bundle(msg.data).replies)
        else:
            probed.append(msg)

    probed: list[Msg] = []
    await nats_client.subscribe("gwlonely.*", cb=on_reply)
    await bus.sync(nats_client)
    x = encode_tensors([tensor_from_numpy("input", np.ones((1, 2), np.float32))])
    requests = [
        BundledRequest(Envelope(f"r{t}", "lonely", time.time_ns() + 10**10), t) for t in (3, 4, 5)
    ]
    async with running_router(nats_server.url, "r-lonely") as (_, catalog, _):
        await wait_route(catalog, route)
        # A probe answered UNAVAILABLE (no batcher) shows the router takes requests.
        await _probe_until(nats_client, "lonely", lambda: bool(probed), reply="gwlonely.probe")
        t0 = time.monotonic()
        await nats_client.publish(
            SUBJECTS.route("lonely"),
            encode_request_bundle("lonely", "", "gwlonely.b", requests, [(x,)] * 3),
        )
        await wait_until(lambda: len(replies) == 3, 10)
        assert time.monotonic() - t0 < 5  # not the 10 s deadline
        assert sorted((r.token, r.status) for r in replies) == [
            (3, "UNAVAILABLE"),
            (4, "UNAVAILABLE"),
            (5, "UNAVAILABLE"),
        ]
        assert "no batcher" in replies[0].error


async def _probe_until(
    nc: Client, model: str, arrived: Callable[[], bool], *, reply: str = "test.reply"
) -> None:
    """Send pinned probes (bundles of one) until `arrived()`: a fresh router
    subscription can miss the first message published right after it (see
    `Forwarded.probe`)."""
    deadline = time.monotonic() + 10
    k = 0
    while not arrived():
        assert time.monotonic() < deadline, "router takes no requests"
        await send_request(nc, model, f"probe-{k}", pin="stable", inbox=reply)
        k += 1
        await asyncio.sleep(0.02)


async def test_the_old_single_request_form_is_refused(nats_server, nats_client) -> None:
    """A tensor request as headers and a bare frame (the form before bundles) gets
    INVALID_ARGUMENT on its reply subject and is never forwarded; so does a bundle
    for another model than its subject names."""
    route = Route(model="oldform", stable="1", versions=["1"])
    await put_route(nats_client.jetstream(), route)
    seen = Forwarded("oldform")
    await seen.subscribe(nats_client)
    answers: asyncio.Queue[Msg] = asyncio.Queue()
    await nats_client.subscribe("old.reply", cb=answers.put)
    await bus.sync(nats_client)
    frame = encode_tensors([tensor_from_numpy("input", np.ones((1, 2), np.float32))])
    async with running_router(nats_server.url, "r-old") as (_, catalog, _):
        await wait_route(catalog, route)
        await seen.probe(nats_client)
        await nats_client.publish(
            SUBJECTS.route("oldform"),
            frame,
            headers={h.MODEL: "oldform", h.REQUEST_ID: "old-1", h.REPLY: "old.reply"},
        )
        msg = await asyncio.wait_for(answers.get(), 10)
        # A bundle for another model than its subject names: refused, not routed.
        bundles: asyncio.Queue[Msg] = asyncio.Queue()
        await nats_client.subscribe("other.reply.b", cb=bundles.put)
        env = Envelope("x", "split", time.time_ns() + 10**10)
        await nats_client.publish(
            SUBJECTS.route("oldform"),
            encode_request_bundle(
                "split", "", "other.reply.b", [BundledRequest(env, 4)], [(frame,)]
            ),
        )
        refused = decode_reply_bundle((await asyncio.wait_for(bundles.get(), 10)).data)
    assert [(r.token, r.status) for r in refused.replies] == [(4, "INVALID_ARGUMENT")]
    assert msg.headers[h.STATUS] == "INVALID_ARGUMENT"
    assert "request bundles (IBQ1)" in msg.headers[h.ERROR]
    assert msg.headers[h.REQUEST_ID] == "old-1"
    assert seen.by_request == {}
    with pytest.raises(FrameError):
        decode_request_bundle(frame)
