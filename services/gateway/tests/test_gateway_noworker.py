"""No live worker (`inferbus_gateway.dispatch.noworker`): the rule, the answer, the
liveness probe and the sweep of requests already sent, over a real nats-server."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from inferbus_common import bus
from inferbus_common.catalog import (
    Catalog,
    DeployedVersion,
    LastWorker,
    Route,
    WorkerStatus,
    ensure_kv,
)
from inferbus_common.errors import FailedPrecondition, Unavailable
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission.breaker import counts_as_failure
from inferbus_gateway.dispatch.noworker import (
    NoLiveWorker,
    WorkerWatch,
    no_worker_error,
    wait_for_worker_s,
)
from inferbus_gateway.pipeline.handler import Readiness

pytestmark = pytest.mark.integration

S = Subjects("ib")
WAIT = 5.0
CONFIG = ModelConfig.model_validate(
    {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
        "pool": "cpu-a",
    }
)
DV = DeployedVersion(model="fraud", version="1.0.0", config=CONFIG)


def _last(lost_ms: float) -> LastWorker:
    return LastWorker("w-1", "h", 7, int(lost_ms) - 500, int(lost_ms), "gone")


# --- the rule ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("grace_s", "lost_ago_s", "timeout_s", "wait_s"),
    [
        (0.0, 0.1, 30.0, 0.0),  # the default: never wait
        (5.0, 1.0, 30.0, 4.0),  # within the grace, deadline past its end: wait it out
        (5.0, 1.0, 4.0, 0.0),  # deadline before the grace ends: a worker cannot help in time
        (5.0, 1.0, 4.5, 4.0),  # just past it: wait
        (5.0, 6.0, 30.0, 0.0),  # the grace is over: answer now
    ],
)
def test_a_request_waits_only_while_a_worker_may_come_back_in_time(
    grace_s: float, lost_ago_s: float, timeout_s: float, wait_s: float
) -> None:
    now_ms = 1_000_000_000.0
    got = wait_for_worker_s(
        _last(now_ms - lost_ago_s * 1000), now_ms=now_ms, timeout_s=timeout_s, grace_s=grace_s
    )
    assert got == pytest.approx(wait_s)


def test_never_served_since_start_means_answer_now() -> None:
    assert wait_for_worker_s(None, now_ms=1e12, timeout_s=30, grace_s=10) == 0.0


def test_the_breaker_does_not_count_a_no_worker_answer() -> None:
    assert counts_as_failure(NoLiveWorker("x")) is None
    assert counts_as_failure(Unavailable("x")) is True


# --- with a real catalog -------------------------------------------------------------
def _worker(worker_id: str, state: str, *, alive: str = "", age_s: float = 0.0) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        pool="cpu-a",
        models={"fraud/1.0.0": state},
        ts_ms=int((time.time() - age_s) * 1000),
        host="node-7",
        pid=4242,
        alive_subject=alive,
    )


async def _catalog_with(nc: Client, *workers: WorkerStatus) -> tuple[Catalog, object]:
    js = nc.jetstream()
    kv = await ensure_kv(js, S.workers_bucket)
    routes = await ensure_kv(js, S.routes_bucket)
    models = await ensure_kv(js, S.models_bucket)
    await routes.put(
        S.model_key("fraud"), Route(model="fraud", stable="1.0.0").model_dump_json().encode()
    )
    await models.put(S.model_key("fraud", "1.0.0"), DV.model_dump_json().encode())
    for w in workers:
        await kv.put(w.worker_id, w.model_dump_json().encode())
    catalog = Catalog(js, S)
    await catalog.__aenter__()
    await catalog.wait_loaded(WAIT)
    assert await catalog.wait_for(lambda: len(catalog.workers) == len(workers), WAIT)
    return catalog, kv


async def test_a_gone_worker_is_answered_at_once_naming_what_an_operator_needs(
    nats_client: Client,
) -> None:
    catalog, _ = await _catalog_with(nats_client, _worker("w-1", "ready"))
    try:
        assert catalog.is_ready("fraud", "1.0.0")
        readiness = Readiness(catalog)
        assert await readiness.wait(DV, 10.0) == 10.0
        assert catalog.mark_gone("w-1")
        assert not catalog.mark_gone("w-1")  # once
        assert not catalog.is_ready("fraud", "1.0.0")
        assert catalog.version_state("fraud", "1.0.0") == "no worker"
        t0 = time.perf_counter()
        with pytest.raises(NoLiveWorker) as err:
            await readiness.wait(DV, 10.0)
        assert time.perf_counter() - t0 < 0.5
        text = str(err.value)
        for part in (
            "model 'fraud' version '1.0.0': no worker serves it",
            "worker 'w-1' (node-7, pid 4242)",
            "connection to NATS closed",
            "last heartbeat",
            "pool 'cpu-a' has 0 live workers",
        ):
            assert part in text, text
    finally:
        await catalog.__aexit__(None, None, None)


async def test_a_stopped_or_stale_worker_is_named_too(nats_client: Client) -> None:
    catalog, kv = await _catalog_with(
        nats_client, _worker("w-1", "ready"), _worker("w-old", "ready", age_s=60)
    )
    try:
        await kv.delete("w-1")  # type: ignore[attr-defined]
        assert await catalog.wait_for(lambda: "w-1" not in catalog.workers, WAIT)
        last = catalog.last_worker("fraud", "1.0.0")
        assert last is not None and (last.worker_id, last.how) == ("w-1", "stopped")
        assert "it stopped (its record was deleted)" in str(
            no_worker_error(catalog, "fraud", "1.0.0", "cpu-a")
        )
    finally:
        await catalog.__aexit__(None, None, None)
    catalog, _ = await _catalog_with(nats_client, _worker("w-old", "ready", age_s=60))
    try:
        last = catalog.last_worker("fraud", "1.0.0")
        assert last is not None and (last.worker_id, last.how) == ("w-old", "stale")
        assert "its heartbeat stopped" in str(no_worker_error(catalog, "fraud", "1.0.0", "cpu-a"))
    finally:
        await catalog.__aexit__(None, None, None)


async def test_within_the_grace_a_long_request_waits_for_the_worker_to_come_back(
    nats_client: Client,
) -> None:
    catalog, kv = await _catalog_with(nats_client, _worker("w-1", "ready"))
    try:
        catalog.mark_gone("w-1")
        readiness = Readiness(catalog, no_worker_grace_s=3.0)
        # Its deadline ends within the grace: a worker cannot help in time.
        with pytest.raises(NoLiveWorker):
            await readiness.wait(DV, 1.0)
        waiting = asyncio.ensure_future(readiness.wait(DV, 30.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await kv.put("w-2", _worker("w-2", "ready").model_dump_json().encode())  # type: ignore[attr-defined]
        left = await asyncio.wait_for(waiting, WAIT)
        assert 25.0 < left < 30.0
    finally:
        await catalog.__aexit__(None, None, None)


async def test_after_the_grace_the_answer_comes_at_once(nats_client: Client) -> None:
    catalog, _ = await _catalog_with(nats_client, _worker("w-1", "ready"))
    try:
        catalog.mark_gone("w-1")
        readiness = Readiness(catalog, no_worker_grace_s=0.3)
        t0 = time.perf_counter()
        with pytest.raises(NoLiveWorker):
            await readiness.wait(DV, 30.0)  # waits out the rest of the grace
        assert 0.1 < time.perf_counter() - t0 < 2.0
        t0 = time.perf_counter()
        with pytest.raises(NoLiveWorker):
            await readiness.wait(DV, 30.0)
        assert time.perf_counter() - t0 < 0.1
    finally:
        await catalog.__aexit__(None, None, None)


async def test_loading_and_rejected_versions_keep_their_answers(nats_client: Client) -> None:
    catalog, _ = await _catalog_with(nats_client, _worker("w-1", "loading"))
    try:
        with pytest.raises(Unavailable, match=r"not ready \(loading\)") as err:
            await Readiness(catalog).wait(DV, 5.0)
        assert not isinstance(err.value, NoLiveWorker)
    finally:
        await catalog.__aexit__(None, None, None)
    catalog, _ = await _catalog_with(nats_client, _worker("w-1", "failed permanently: bad digest"))
    try:
        with pytest.raises(FailedPrecondition):
            await Readiness(catalog, no_worker_grace_s=5.0).wait(DV, 30.0)
    finally:
        await catalog.__aexit__(None, None, None)


# --- the liveness probe and the sweep --------------------------------------------------
async def test_the_probe_finds_a_dead_worker_and_the_sweep_answers_its_requests(
    nats_client: Client,
) -> None:
    alive = S.alive("w-1")

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(b"")

    sub = await nats_client.subscribe(alive, cb=answer)
    catalog, kv = await _catalog_with(nats_client, _worker("w-1", "ready", alive=alive))
    swept: list[tuple[str, str, int | None, str]] = []

    def fail_pending(model: str, version: str, before_ns: int | None, error: Unavailable) -> int:
        swept.append((model, version, before_ns, str(error)))
        return 1

    try:
        async with WorkerWatch(nats_client, catalog, fail_pending, interval_s=0.05) as watch:
            await asyncio.sleep(0.3)  # several probes, all answered
            assert catalog.is_ready("fraud", "1.0.0") and watch.found_gone == 0
            assert swept == []
            await sub.unsubscribe()  # what nats-server sees when the process dies
            for _ in range(int(WAIT / 0.01)):  # probes every 0.05 s: found within a few
                if swept:
                    break
                await asyncio.sleep(0.01)
            assert not catalog.is_ready("fraud", "1.0.0")
            assert watch.found_gone == 1
            # Grace 0: every request waiting for this version is answered.
            model, version, before_ns, text = swept[0]
            assert (model, version, before_ns) == ("fraud", "1.0.0", None)
            assert "no worker serves it" in text
            # It reconnects (answers probes again) and heartbeats: it counts again.
            await nats_client.subscribe(alive, cb=answer)
            await bus.sync(nats_client)
            await kv.put("w-1", _worker("w-1", "ready", alive=alive).model_dump_json().encode())  # type: ignore[attr-defined]
            assert await catalog.wait_for(lambda: catalog.is_ready("fraud", "1.0.0"), WAIT)
    finally:
        await catalog.__aexit__(None, None, None)


async def test_a_probe_the_dying_worker_swallowed_does_not_hold_back_the_verdict(
    nats_client: Client,
) -> None:
    # The worker takes a probe and dies before answering it (kill -9 between the
    # two): that probe waits out its 1 s timeout. The verdict must come from the
    # next probes, which nats-server answers "no responders" at once.
    alive = S.alive("w-1")
    swallowed = asyncio.Event()
    sub: Subscription | None = None

    async def die_on_probe(msg) -> None:  # type: ignore[no-untyped-def]
        swallowed.set()
        assert sub is not None
        await sub.unsubscribe()

    sub = await nats_client.subscribe(alive, cb=die_on_probe)
    catalog, _ = await _catalog_with(nats_client, _worker("w-1", "ready", alive=alive))
    try:
        async with WorkerWatch(nats_client, catalog, None, interval_s=0.05) as watch:
            async with asyncio.timeout(WAIT):
                await swallowed.wait()
            t0 = time.monotonic()
            for _ in range(int(WAIT / 0.01)):
                if watch.found_gone:
                    break
                await asyncio.sleep(0.01)
            assert watch.found_gone == 1
            # A few probe periods, not the swallowed probe's 1 s timeout.
            assert time.monotonic() - t0 < 0.6
            assert not catalog.is_ready("fraud", "1.0.0")
    finally:
        await catalog.__aexit__(None, None, None)


async def test_the_sweep_keeps_requests_that_may_still_be_served_within_the_grace(
    nats_client: Client,
) -> None:
    catalog, _ = await _catalog_with(nats_client, _worker("w-1", "ready"))
    swept: list[int | None] = []

    def fail_pending(model: str, version: str, before_ns: int | None, error: Unavailable) -> int:
        swept.append(before_ns)
        return 0

    try:
        catalog.mark_gone("w-1")
        last = catalog.last_worker("fraud", "1.0.0")
        assert last is not None
        watch = WorkerWatch(nats_client, catalog, fail_pending, interval_s=0, grace_s=5.0)
        watch.sweep(now_ms=last.lost_ms + 1000)
        assert swept == [int((last.lost_ms + 5000) * 1e6)]  # those due before the grace ends
        watch.sweep(now_ms=last.lost_ms + 5100)
        assert swept[-1] is None  # the grace is over: all of them
        watch.sweep(now_ms=last.lost_ms + 60_000)
        assert len(swept) == 2  # long lost: nothing left to sweep
    finally:
        await catalog.__aexit__(None, None, None)
