"""The rollout controller against a real registry and NATS KV, judged by audit records
that the tests publish themselves on ``<prefix>.audit.<model>`` (the gateway's contract)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from inferbus_client.registry import RegistryClient
from inferbus_common import bus
from inferbus_common.catalog import Route, WorkerStatus, ensure_kv
from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_common.versionhealth import WindowStats, percentile
from inferbus_registry.app import RegistryApp
from inferbus_registry.rollout import Rollout, check_plan, evaluate
from inferbus_testing.records import audit_record

# --- the step logic, pure ------------------------------------------------------------


def _rollout(**kw: object) -> Rollout:
    fields: dict[str, object] = {
        "id": "r",
        "model": "m",
        "version": "2",
        "previous_stable": "1",
        "steps": [10.0, 100.0],
        "interval_s": 10.0,
        "min_requests": 10,
        "step_started_unix_ms": 0,
    }
    fields.update(kw)
    return Rollout.model_validate(fields)


def _stats(requests: int = 0, errors: int = 0, ms: float = 1.0, *, slow: int = 0) -> WindowStats:
    """A window: `requests` outcomes, `errors` of them faults, the successes at `ms`
    except `slow` of them at 100 x `ms`."""
    ok = requests - errors
    latencies = tuple(sorted([ms] * (ok - slow) + [ms * 100] * slow))
    return WindowStats(requests, errors, latencies)


def test_errors_fail_the_step_before_the_interval_ends() -> None:
    d = evaluate(_rollout(), _stats(10, errors=2), _stats(90), 1_000)
    assert d.action == "fail" and "error rate 20.0% (2/10)" in d.reason


def test_one_error_in_few_requests_is_no_evidence() -> None:
    # 1 of 20 over a 1 % limit: could well be a 1 % canary (p = 0.18), so no verdict yet.
    assert evaluate(_rollout(), _stats(20, errors=1), _stats(90), 1_000).action == "wait"
    assert evaluate(_rollout(), _stats(20, errors=1), _stats(90), 10_000).action == "advance"


def test_too_few_requests_never_advance() -> None:
    d = evaluate(_rollout(), _stats(9), _stats(90), 60_000)
    assert d.action == "wait" and "waiting for 10 canary requests (have 9)" in d.reason


def test_window_must_pass_before_advancing() -> None:
    assert evaluate(_rollout(), _stats(50, ms=2), _stats(50, ms=2), 5_000).action == "wait"
    assert evaluate(_rollout(), _stats(50, ms=2), _stats(50, ms=2), 10_000).action == "advance"


def test_slow_canary_fails_on_p99_and_slack_forgives_tiny_latencies() -> None:
    r = _rollout()
    slow = evaluate(r, _stats(50, ms=100), _stats(50, ms=10), 10_000)
    assert slow.action == "fail" and "p99 100.0 ms" in slow.reason
    tiny = evaluate(r, _stats(50, ms=3), _stats(50, ms=1), 10_000)
    assert tiny.action == "advance"
    # One slow request among 50 is no evidence of a slow canary.
    assert evaluate(r, _stats(50, ms=10, slow=1), _stats(50, ms=10), 10_000).action == "advance"
    # At 100 % stable serves nothing: the baseline from earlier steps is used.
    base = _rollout(stable_p99_ms=10.0)
    assert evaluate(base, _stats(50, ms=100), _stats(), 10_000).action == "fail"


def test_errors_stable_also_suffers_are_not_blamed_on_the_canary() -> None:
    d = evaluate(_rollout(), _stats(20, errors=2), _stats(100, errors=10), 10_000)
    assert d.action == "advance"


def test_plans_are_checked() -> None:
    check_plan([5, 25, 50, 100], 60, 0.01, 1.5, 20, "rollback")
    for steps in ([], [50, 25, 100], [5, 50], [0, 100], [5, 101]):
        with pytest.raises(InvalidArgument):
            check_plan(steps, 60, 0.01, 1.5, 20, "rollback")
    with pytest.raises(InvalidArgument, match="on-fail"):
        check_plan([100], 60, 0.01, 1.5, 20, "explode")


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0


# --- the controller in a registry ------------------------------------------------


@pytest.fixture
async def fast_registry(start_registry: Callable[..., RegistryApp]) -> AsyncIterator[RegistryApp]:
    async with start_registry(rollout_tick_s=0.05) as app:
        yield app


@pytest.fixture
async def rclient(fast_registry: RegistryApp) -> AsyncIterator[RegistryClient]:
    async with RegistryClient(f"127.0.0.1:{fast_registry.grpc_port}", timeout_s=10) as c:
        yield c


@pytest.fixture
async def nc(fast_registry: RegistryApp) -> AsyncIterator[Client]:
    conn = await nats.connect(fast_registry.settings.nats_url)
    try:
        yield conn
    finally:
        await conn.close()


async def heartbeat(nc: Client, app: RegistryApp, *ready: str, admitted: bool = True) -> None:
    """A worker's heartbeat that reports ``model/version`` entries ready (what workers write)."""
    kv = await ensure_kv(nc.jetstream(), app.subjects.workers_bucket)
    status = WorkerStatus(
        worker_id="w-test",
        pool="default",
        models=dict.fromkeys(ready, "ready"),
        ts_ms=int(time.time() * 1000),
        admitted=admitted,
    )
    await kv.put("w-test", status.model_dump_json().encode())


@pytest.fixture
async def model(
    rclient: RegistryClient,
    make_version: Callable[..., Path],
    nc: Client,
    fast_registry: RegistryApp,
) -> str:
    await rclient.push(make_version(), "m", "1", aliases=["stable"])
    await rclient.push(make_version(seed=0.25), "m", "2")
    await rclient.push(make_version(seed=0.75), "m", "3")
    await heartbeat(nc, fast_registry, "m/1", "m/2", "m/3")
    return "m"


_ids = itertools.count()


def _record(model: str, version: str, status: str, latency_ms: float) -> bytes:
    return audit_record(
        model,
        version,
        status,
        request_id=f"req-{next(_ids)}",
        latency_ms=latency_ms,
        ts_unix_ms=time.time_ns() // 1_000_000,
        gateway="test",
        tenant="t",
    )


async def _probe(nc: Client, app: RegistryApp) -> None:
    """Make sure the controller's audit subscription receives (fresh-SUB drop trap)."""
    assert app.rollouts is not None
    deadline = time.monotonic() + 10
    while app.rollouts.audit_records_seen == 0:
        assert time.monotonic() < deadline, "the controller never saw an audit record"
        await nc.publish(app.subjects.audit("probe"), _record("probe", "1", "OK", 1.0))
        await bus.sync(nc)
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def traffic(
    nc: Client,
    app: RegistryApp,
    model: str,
    canary: tuple[str, str, float],
    stable: tuple[str, str, float] = ("1", "OK", 2.0),
) -> AsyncIterator[None]:
    """Publish audit records like a gateway would: (version, status, latency) each,
    batched as the gateway sends them (one message, one record per line)."""
    await _probe(nc, app)
    stop = asyncio.Event()

    async def feed() -> None:
        while not stop.is_set():
            batch = [_record(model, v, status, latency) for v, status, latency in (canary, stable)]
            await nc.publish(app.subjects.audit(model), b"\n".join(batch))
            await asyncio.sleep(0.005)

    task = asyncio.create_task(feed())
    try:
        yield
    finally:
        stop.set()
        await task


async def _wait_state(
    client: RegistryClient, model: str, states: set[str], timeout: float = 20
) -> Rollout:
    deadline = time.monotonic() + timeout
    while True:
        r = Rollout.model_validate_json((await client.get_rollout(model)).rollout_json)
        if r.state in states:
            return r
        assert time.monotonic() < deadline, f"rollout stuck in {r.state}: {r.reason}"
        await asyncio.sleep(0.05)


async def _route(client: RegistryClient, model: str, history: int = 0) -> tuple[Route, list[Route]]:
    state = await client.get_route(model, history=history)
    return Route.model_validate_json(state.route_json), [
        Route.model_validate_json(h) for h in state.history_json
    ]


async def _route_where(
    client: RegistryClient, model: str, predicate: Callable[[Route], bool], timeout: float = 5
) -> Route:
    """The route once `predicate` holds (the controller applies a record's effect right after)."""
    deadline = time.monotonic() + timeout
    route = (await _route(client, model))[0]
    while not predicate(route):
        assert time.monotonic() < deadline, f"route never matched: {route}"
        await asyncio.sleep(0.05)
        route = (await _route(client, model))[0]
    return route


async def test_healthy_canary_reaches_100_and_becomes_stable(
    rclient: RegistryClient, fast_registry: RegistryApp, nc: Client, model: str
) -> None:
    events = await nc.subscribe(fast_registry.subjects.events(model))
    await bus.sync(nc)
    async with traffic(nc, fast_registry, model, ("2", "OK", 2.0)):
        started = Rollout.model_validate_json(
            (
                await rclient.start_rollout(
                    model,
                    "2",
                    steps=[20, 60, 100],
                    interval_s=0.3,
                    min_requests=5,
                    requested_by="alice",
                )
            ).rollout_json
        )
        assert started.state == "running" and started.weight == 20
        # Weight 0 while warming up, step 1's weight once a worker reports it ready.
        route = await _route_where(rclient, model, lambda r: r.canary_weight == 20.0)
        assert route.canary == "2"
        done = await _wait_state(rclient, model, {"succeeded", "rolled_back"})
    assert done.state == "succeeded", done.reason
    assert [h.outcome for h in done.history] == ["passed", "passed", "passed"]
    assert [h.weight for h in done.history] == [20.0, 60.0, 100.0]
    assert all(h.canary.requests >= 5 for h in done.history)

    # The version is stable and no canary is left behind.
    deadline = time.monotonic() + 5
    while True:
        route, history = await _route(rclient, model, history=4)
        if route.stable == "2" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert route.stable == "2" and route.aliases["stable"] == "2"
    assert route.canary == "" and route.canary_weight == 0.0
    assert "promoted to stable" in route.change and route.updated_by.startswith("rollout r-")
    # The audit trail: each step is a route change with its text.
    changes = [route.change] + [h.change for h in history]
    for k, w in ((1, 20), (2, 60), (3, 100)):
        assert f"rollout {done.id} step {k}: weight {w}" in changes, changes

    seen = []
    with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
        while True:
            seen.append(json.loads((await events.next_msg(timeout=0.5)).data)["event"])
    rollout_events = [e for e in seen if e.startswith("rollout_")]
    assert rollout_events == [
        "rollout_started",
        "rollout_canary_ready",
        "rollout_step",
        "rollout_step",
        "rollout_succeeded",
    ]
    assert "route_changed" in seen


async def test_failing_canary_is_rolled_back_at_its_first_step(
    rclient: RegistryClient, fast_registry: RegistryApp, nc: Client, model: str
) -> None:
    async with traffic(nc, fast_registry, model, ("2", "INTERNAL", 2.0)):
        await rclient.start_rollout(model, "2", steps=[10, 100], interval_s=30, min_requests=5)
        done = await _wait_state(rclient, model, {"rolled_back", "succeeded"})
    assert done.state == "rolled_back" and "error rate" in done.reason
    assert len(done.history) == 1 and done.history[0].outcome == "failed"
    assert done.history[0].canary.errors >= 5
    route = await _route_where(rclient, model, lambda r: not r.canary)
    assert route.stable == "1" and route.canary == "" and route.canary_weight == 0.0
    assert "rolled back: canary cleared" in route.change


async def test_slow_canary_is_rolled_back_and_pause_policy_holds_the_weight(
    rclient: RegistryClient, fast_registry: RegistryApp, nc: Client, model: str
) -> None:
    async with traffic(nc, fast_registry, model, ("2", "OK", 250.0)):
        await rclient.start_rollout(
            model, "2", steps=[10, 100], interval_s=0.3, min_requests=5, on_fail="pause"
        )
        paused = await _wait_state(rclient, model, {"paused", "rolled_back", "succeeded"})
    assert paused.state == "paused" and "p99" in paused.reason
    route, _ = await _route(rclient, model)
    assert (route.canary, route.canary_weight) == ("2", 10.0)  # held for the operator
    # The operator rolls it back by hand.
    back = Rollout.model_validate_json(
        (await rclient.control_rollout(model, "rollback", requested_by="ops")).rollout_json
    )
    assert back.state == "rolled_back" and back.reason == "rollback by ops"
    route, _ = await _route(rclient, model)
    assert route.canary == "" and route.canary_weight == 0.0 and route.stable == "1"


async def test_two_rollouts_in_a_row_leave_no_stale_route(
    rclient: RegistryClient, fast_registry: RegistryApp, nc: Client, model: str
) -> None:
    revisions = [(await _route(rclient, model))[0].revision]
    first = Rollout.model_validate_json(
        (await rclient.start_rollout(model, "2", steps=[10, 100], interval_s=60)).rollout_json
    )
    with pytest.raises(FailedPrecondition, match=f"rollout {first.id} .* is running"):
        await rclient.start_rollout(model, "3", steps=[10, 100], interval_s=60)
    with pytest.raises(FailedPrecondition, match="owns the canary"):
        await rclient.set_traffic(model, canary="3", canary_weight=5)
    revisions.append((await _route(rclient, model))[0].revision)
    await rclient.control_rollout(model, "pause")
    await rclient.control_rollout(model, "resume")
    aborted = Rollout.model_validate_json(
        (await rclient.control_rollout(model, "abort")).rollout_json
    )
    assert aborted.state == "aborted"
    route, _ = await _route(rclient, model)
    assert route.canary == "" and route.canary_weight == 0.0
    revisions.append(route.revision)

    async with traffic(nc, fast_registry, model, ("3", "OK", 2.0)):
        second = Rollout.model_validate_json(
            (
                await rclient.start_rollout(
                    model, "3", steps=[50, 100], interval_s=0.3, min_requests=5
                )
            ).rollout_json
        )
        assert second.id != first.id and second.previous_stable == "1"
        assert [h.step for h in second.history] == [1]  # nothing carried over
        done = await _wait_state(rclient, model, {"succeeded", "rolled_back"})
    assert done.state == "succeeded", done.reason
    route = await _route_where(rclient, model, lambda r: r.stable == "3")
    assert route.canary == "" and route.canary_weight == 0.0
    revisions.append(route.revision)
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)

    # A rollback after success moves stable back to where the rollout found it.
    back = Rollout.model_validate_json(
        (await rclient.control_rollout(model, "rollback")).rollout_json
    )
    assert back.state == "rolled_back" and back.restored_stable == "1"
    route = await _route_where(rclient, model, lambda r: r.stable == "1")
    assert route.canary == ""


async def test_a_restarted_registry_resumes_the_rollout(
    start_registry: Callable[..., RegistryApp], make_version: Callable[..., Path]
) -> None:
    async with start_registry(rollout_tick_s=0.05) as app:
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}", timeout_s=10) as c:
            await c.push(make_version(), "m", "1", aliases=["stable"])
            await c.push(make_version(seed=0.25), "m", "2")
            conn = await nats.connect(app.settings.nats_url)
            await heartbeat(conn, app, "m/2")
            await conn.close()
            await c.start_rollout("m", "2", steps=[30, 100], interval_s=0.3, min_requests=5)
    # The first registry is gone; a new one picks the record up from KV.
    async with start_registry(rollout_tick_s=0.05) as app:
        conn = await nats.connect(app.settings.nats_url)
        try:
            async with RegistryClient(f"127.0.0.1:{app.grpc_port}", timeout_s=10) as c:
                r = Rollout.model_validate_json((await c.get_rollout("m")).rollout_json)
                assert r.state == "running" and r.step == 0
                await heartbeat(conn, app, "m/2")
                async with traffic(conn, app, "m", ("2", "OK", 2.0)):
                    done = await _wait_state(c, "m", {"succeeded", "rolled_back"})
                assert done.state == "succeeded" and done.id == r.id
        finally:
            await conn.close()


async def test_no_evidence_no_progress(
    rclient: RegistryClient, fast_registry: RegistryApp, model: str
) -> None:
    await rclient.start_rollout(model, "2", steps=[10, 100], interval_s=0.2, min_requests=5)
    await asyncio.sleep(1.0)
    r = Rollout.model_validate_json((await rclient.get_rollout(model)).rollout_json)
    assert r.state == "running" and r.step == 0
    assert (await _route(rclient, model))[0].canary_weight == 10.0


async def test_a_canary_that_never_loads_is_rolled_back(
    rclient: RegistryClient,
    fast_registry: RegistryApp,
    nc: Client,
    make_version: Callable[..., Path],
) -> None:
    await rclient.push(make_version(), "m", "1", aliases=["stable"])
    await rclient.push(make_version(seed=0.25), "m", "2")
    kv = await ensure_kv(nc.jetstream(), fast_registry.subjects.workers_bucket)
    status = WorkerStatus(
        worker_id="w-bad",
        pool="default",
        models={"m/2": "failed: cannot load model.onnx"},
        ts_ms=int(time.time() * 1000),
    )
    await kv.put("w-bad", status.model_dump_json().encode())
    started = Rollout.model_validate_json(
        (
            await rclient.start_rollout(
                "m", "2", steps=[10, 100], interval_s=0.2, min_requests=1, ready_timeout_s=0.5
            )
        ).rollout_json
    )
    assert started.ready_unix_ms == 0
    # While warming up the canary is in the route at weight 0 (so workers load it).
    route = await _route_where(rclient, "m", lambda r: r.canary == "2")
    assert route.canary_weight == 0.0
    done = await _wait_state(rclient, "m", {"rolled_back"})
    assert "not ready after 0.5s (failed: cannot load model.onnx)" in done.reason
    route = await _route_where(rclient, "m", lambda r: not r.canary)
    assert route.stable == "1"


async def test_a_restarted_registry_replays_the_steps_evidence_from_the_audit_stream(
    start_registry: Callable[..., RegistryApp],
    make_version: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_registry.rollout")
    from inferbus_common.audittrail import ensure_audit_stream

    async with start_registry(rollout_tick_s=0.05) as app:
        conn = await nats.connect(app.settings.nats_url)
        try:
            # The gateway creates the audit stream; here the test does.
            await ensure_audit_stream(conn.jetstream(), app.subjects, storage="memory")
            async with RegistryClient(f"127.0.0.1:{app.grpc_port}", timeout_s=10) as c:
                await c.push(make_version(), "m", "1", aliases=["stable"])
                await c.push(make_version(seed=0.25), "m", "2")
                await heartbeat(conn, app, "m/2")
                await c.start_rollout("m", "2", steps=[30, 100], interval_s=2.0, min_requests=5)
                await _route_where(c, "m", lambda r: r.canary_weight == 30.0)
                for _ in range(10):
                    for version in ("1", "2"):
                        await conn.publish(app.subjects.audit("m"), _record("m", version, "OK", 2))
                await bus.sync(conn)
                r = Rollout.model_validate_json((await c.get_rollout("m")).rollout_json)
                assert r.step == 0  # the first registry stops before the step's interval ends
        finally:
            await conn.close()
    # The evidence was published while the first registry ran; the new one
    # gets no live traffic at all and must advance on what the stream kept.
    async with start_registry(rollout_tick_s=0.05) as app:
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}", timeout_s=10) as c:
            deadline = time.monotonic() + 15
            while True:
                r = Rollout.model_validate_json((await c.get_rollout("m")).rollout_json)
                if r.step == 1 or r.state != "running":
                    break
                assert time.monotonic() < deadline, f"no progress: {r.reason}"
                await asyncio.sleep(0.1)
    assert r.state == "running" and r.step == 1, r.reason
    assert r.history[0].outcome == "passed" and r.history[0].canary.requests == 10
    assert "with 20 audit records replayed" in caplog.text


async def test_unset_thresholds_get_the_documented_defaults(
    fast_registry: RegistryApp, model: str
) -> None:
    import grpc

    from inferbus_proto.registry import registry_pb2, registry_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{fast_registry.grpc_port}") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        state = await stub.StartRollout(
            registry_pb2.StartRolloutRequest(model=model, version="2", steps=[100], interval_s=60)
        )
    r = Rollout.model_validate_json(state.rollout_json)
    assert (r.max_error_rate, r.max_p99_ratio, r.min_requests, r.on_fail) == (
        0.01,
        1.5,
        20,
        "rollback",
    )


async def test_archived_versions_and_unloaded_models_get_no_rollout(
    rclient: RegistryClient, model: str
) -> None:
    await rclient.archive(model, "2", requested_by="ops")
    with pytest.raises(FailedPrecondition, match="'2' of 'm' is archived"):
        await rclient.start_rollout(model, "2", steps=[10, 100], interval_s=0.2)
    await rclient.set_serving(model, False, requested_by="ops")
    with pytest.raises(FailedPrecondition, match=r"'m' is unloaded \(SetServing off\)"):
        await rclient.start_rollout(model, "3", steps=[10, 100], interval_s=0.2)


async def test_unloading_the_model_mid_rollout_aborts_it_and_resume_is_refused(
    rclient: RegistryClient, fast_registry: RegistryApp, nc: Client, model: str
) -> None:
    await rclient.start_rollout(model, "2", steps=[10, 100], interval_s=60)
    await rclient.control_rollout(model, "pause", requested_by="ops")
    await rclient.set_serving(model, False, requested_by="ops")
    with pytest.raises(FailedPrecondition, match=r"'m' is unloaded \(SetServing off\)"):
        await rclient.control_rollout(model, "resume", requested_by="ops")
    await rclient.set_serving(model, True, requested_by="ops")
    await rclient.control_rollout(model, "resume", requested_by="ops")
    await rclient.set_serving(model, False, requested_by="ops")
    ended = await _wait_state(rclient, model, {"aborted"}, timeout=10)
    assert "unloaded" in ended.reason and ended.history[-1].outcome == "aborted"
    await rclient.set_serving(model, True, requested_by="ops")
    route = (await _route(rclient, model))[0]
    assert (route.stable, route.canary, route.canary_weight) == ("1", "", 0.0)
