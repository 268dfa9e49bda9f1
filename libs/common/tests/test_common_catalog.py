"""The live catalog over NATS KV (`inferbus_common.catalog`), with a real nats-server."""

from __future__ import annotations

import logging
import time

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from inferbus_common.catalog import (
    Catalog,
    DeployedVersion,
    Route,
    WorkerStatus,
    ensure_kv,
)
from inferbus_common.errors import NotFound
from inferbus_common.kvwatch import InitialValues
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.subjects import Subjects

pytestmark = pytest.mark.integration

S = Subjects("ib")
MODEL = "fraud.detector"  # a dot: keys go through subject_token
WAIT = 5.0

CONFIG = ModelConfig.model_validate(
    {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
    }
)


def _version(version: str, model: str = MODEL) -> DeployedVersion:
    return DeployedVersion(
        model=model, version=version, config=CONFIG, digest=f"sha-{version}", files={}
    )


def _worker(worker_id: str, states: dict[str, str], age_s: float = 0.0) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        pool="default",
        models=states,
        ts_ms=int((time.time() - age_s) * 1000),
        host="h",
        pid=1,
    )


@pytest.fixture
def js(nats_client: Client) -> JetStreamContext:
    return nats_client.jetstream()


async def _buckets(js: JetStreamContext) -> tuple[KeyValue, KeyValue, KeyValue]:
    return (
        await ensure_kv(js, S.models_bucket),
        await ensure_kv(js, S.routes_bucket),
        await ensure_kv(js, S.workers_bucket),
    )


async def test_empty_buckets_load(js: JetStreamContext) -> None:
    async with Catalog(js, S) as catalog:
        await catalog.wait_loaded(WAIT)
        assert catalog.versions == {}
        assert catalog.routes == {}
        assert catalog.resolve(MODEL) is None
        assert catalog.version_state(MODEL, "1") == "no worker"
    # The catalog created the buckets (a KV bucket is the stream KV_<bucket>).
    for bucket in (S.models_bucket, S.routes_bucket, S.workers_bucket):
        assert (await js.stream_info(f"KV_{bucket}")).config.name == f"KV_{bucket}"


async def test_ensure_kv_is_idempotent(js: JetStreamContext) -> None:
    first = await ensure_kv(js, "ib_things")
    await first.put("k", b"v")
    second = await ensure_kv(js, "ib_things")
    assert (await second.get("k")).value == b"v"


async def test_existing_entries_are_loaded(js: JetStreamContext) -> None:
    models, routes, workers = await _buckets(js)
    await models.put(S.model_key(MODEL, "1"), _version("1").model_dump_json().encode())
    await routes.put(
        S.model_key(MODEL),
        Route(model=MODEL, stable="1", versions=["1"]).model_dump_json().encode(),
    )
    await workers.put("w1", _worker("w1", {f"{MODEL}/1": "ready"}).model_dump_json().encode())
    async with Catalog(js, S) as catalog:
        await catalog.wait_loaded(WAIT)
        resolved = catalog.resolve(MODEL)
        assert resolved is not None
        assert (resolved.version, resolved.digest) == ("1", "sha-1")
        assert [w.worker_id for w in catalog.ready_workers(MODEL, "1")] == ["w1"]


async def test_resolve_follows_routes_aliases_and_deletes(js: JetStreamContext) -> None:
    models, routes, _ = await _buckets(js)
    changes = 0

    def count() -> None:
        nonlocal changes
        changes += 1

    async with Catalog(js, S, on_change=count) as catalog:
        await catalog.wait_loaded(WAIT)
        for v in ("1", "2"):
            await models.put(S.model_key(MODEL, v), _version(v).model_dump_json().encode())
        route = Route(model=MODEL, stable="1", versions=["1", "2"], aliases={"canary": "2"})
        await routes.put(S.model_key(MODEL), route.model_dump_json().encode())
        assert await catalog.wait_for(lambda: MODEL in catalog.routes, WAIT)
        assert await catalog.wait_for(lambda: len(catalog.versions) == 2, WAIT)

        def version_of(version: str = "") -> str | None:
            dv = catalog.resolve(MODEL, version)
            return None if dv is None else dv.version

        assert version_of() == "1"  # stable
        assert version_of("canary") == "2"  # alias
        assert version_of("2") == "2"  # pinned
        assert version_of("3") is None
        assert catalog.resolve("other") is None
        assert changes >= 3

        # Moving stable is seen live.
        route.stable = "2"
        await routes.put(S.model_key(MODEL), route.model_dump_json().encode())
        assert await catalog.wait_for(lambda: version_of() == "2", WAIT)

        # Deleting a version removes it; purging works the same way.
        await models.delete(S.model_key(MODEL, "1"))
        assert await catalog.wait_for(lambda: (MODEL, "1") not in catalog.versions, WAIT)
        assert version_of("1") is None

        # A version the route names whose record is gone is NOT_FOUND, named.
        route.stable = "1"
        await routes.put(S.model_key(MODEL), route.model_dump_json().encode())
        assert await catalog.wait_for(lambda: catalog.routes[MODEL].stable == "1", WAIT)
        with pytest.raises(NotFound, match=f"model '{MODEL}' version '1' is not deployed"):
            catalog.deployed(MODEL, "stable")
        with pytest.raises(NotFound, match=f"model '{MODEL}' has no version '3' and no alias '3'"):
            catalog.deployed(MODEL, "3")

        # Without a route nothing resolves, pinned or not: the router, which
        # resolves with the same rule, would refuse it (an unloaded model).
        await routes.purge(S.model_key(MODEL))
        assert await catalog.wait_for(lambda: MODEL not in catalog.routes, WAIT)
        assert version_of() is None
        assert version_of("canary") is None
        assert version_of("2") is None
        with pytest.raises(NotFound, match="Request for unknown model"):
            catalog.deployed(MODEL, "2")


async def test_a_version_number_names_its_version(js: JetStreamContext) -> None:
    models, routes, _ = await _buckets(js)
    async with Catalog(js, S) as catalog:
        await catalog.wait_loaded(WAIT)
        for version, number in (("1.0.0", 1), ("1.5.0", 2), ("5", 5)):
            record = _version(version).model_copy(update={"number": number})
            await models.put(S.model_key(MODEL, version), record.model_dump_json().encode())
        route = Route(model=MODEL, stable="1.0.0", versions=["1.0.0", "1.5.0", "5"])
        await routes.put(S.model_key(MODEL), route.model_dump_json().encode())
        # The two buckets are watched apart: wait for the route too, not only the versions.
        assert await catalog.wait_for(
            lambda: len(catalog.versions) == 3 and MODEL in catalog.routes, WAIT
        )

        def version_of(version: str) -> str | None:
            dv = catalog.resolve(MODEL, version)
            return None if dv is None else dv.version

        assert version_of("1") == "1.0.0"
        assert version_of("2") == "1.5.0"
        assert version_of("5") == "5"
        assert version_of("1.5.0") == "1.5.0"
        assert version_of("3") is None


async def test_worker_heartbeats_and_states(js: JetStreamContext) -> None:
    _, _, workers = await _buckets(js)
    key = f"{MODEL}/1"
    async with Catalog(js, S, heartbeat_max_age_s=15.0) as catalog:
        await catalog.wait_loaded(WAIT)
        await workers.put(
            "w-stale", _worker("w-stale", {key: "ready"}, age_s=20).model_dump_json().encode()
        )
        await workers.put("w-load", _worker("w-load", {key: "loading"}).model_dump_json().encode())
        assert await catalog.wait_for(lambda: len(catalog.workers) == 2, WAIT)
        # A stale heartbeat is ignored, even though it says ready.
        assert catalog.ready_workers(MODEL, "1") == []
        assert catalog.version_state(MODEL, "1") == "loading"

        failed = _worker("w-bad", {key: "failed: out of memory"})
        await workers.put("w-bad", failed.model_dump_json().encode())
        assert await catalog.wait_for(lambda: "w-bad" in catalog.workers, WAIT)
        assert catalog.version_state(MODEL, "1") == "failed: out of memory"

        await workers.put("w-ok", _worker("w-ok", {key: "ready"}).model_dump_json().encode())
        assert await catalog.wait_for(lambda: bool(catalog.ready_workers(MODEL, "1")), WAIT)
        assert [w.worker_id for w in catalog.ready_workers(MODEL, "1")] == ["w-ok"]
        assert catalog.version_state(MODEL, "1") == "ready"
        assert catalog.version_state(MODEL, "2") == "no worker"

        await workers.delete("w-ok")
        assert await catalog.wait_for(lambda: "w-ok" not in catalog.workers, WAIT)
        assert catalog.version_state(MODEL, "1") == "failed: out of memory"


async def test_a_worker_found_gone_serves_nothing_until_it_heartbeats_again(
    js: JetStreamContext,
) -> None:
    _, _, workers = await _buckets(js)
    key = f"{MODEL}/1"
    async with Catalog(js, S, heartbeat_max_age_s=15.0) as catalog:
        await catalog.wait_loaded(WAIT)
        assert catalog.last_worker(MODEL, "1") is None  # never served
        await workers.put("w-a", _worker("w-a", {key: "ready"}).model_dump_json().encode())
        await workers.put("w-b", _worker("w-b", {key: "ready"}).model_dump_json().encode())
        assert await catalog.wait_for(lambda: len(catalog.workers) == 2, WAIT)
        assert catalog.is_ready(MODEL, "1") and catalog.last_worker(MODEL, "1") is None
        assert catalog.mark_gone("w-a")
        # The other still serves it.
        assert catalog.is_ready(MODEL, "1")
        assert [w.worker_id for w in catalog.ready_workers(MODEL, "1")] == ["w-b"]
        assert catalog.mark_gone("w-b")
        assert not catalog.is_ready(MODEL, "1")
        assert catalog.ready_workers(MODEL, "1") == [] and catalog.live_workers() == []
        assert catalog.version_state(MODEL, "1") == "no worker"
        last = catalog.last_worker(MODEL, "1")
        assert last is not None and (last.worker_id, last.how) == ("w-b", "gone")
        assert [(m, v) for m, v, _ in catalog.lost_since(last.lost_ms)] == [(MODEL, "1")]
        # An answered probe: it counts again.
        catalog.mark_alive("w-b")
        assert catalog.is_ready(MODEL, "1") and catalog.last_worker(MODEL, "1") is None
        assert catalog.lost_since(0) == []
        # A newer heartbeat of a worker found gone: it counts again.
        newer = _worker("w-a", {key: "ready"}, age_s=-0.05)
        await workers.put("w-a", newer.model_dump_json().encode())
        assert await catalog.wait_for(lambda: "w-a" not in catalog.gone, WAIT)
        assert len(catalog.ready_workers(MODEL, "1")) == 2


async def test_malformed_entries_are_ignored(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    models, _, _ = await _buckets(js)
    async with Catalog(js, S) as catalog:
        await catalog.wait_loaded(WAIT)
        with caplog.at_level(logging.WARNING, logger="inferbus_common.catalog"):
            await models.put("broken.1", b"{not json")
            await models.put(S.model_key(MODEL, "1"), _version("1").model_dump_json().encode())
            assert await catalog.wait_for(lambda: (MODEL, "1") in catalog.versions, WAIT)
        assert len(catalog.versions) == 1
        assert any("ignoring malformed catalog entry broken.1" in r.message for r in caplog.records)


async def test_wait_for_times_out(js: JetStreamContext) -> None:
    async with Catalog(js, S) as catalog:
        await catalog.wait_loaded(WAIT)
        assert await catalog.wait_for(lambda: False, 0.05) is False


async def test_records_round_trip_as_json() -> None:
    route = Route(model=MODEL, stable="2", versions=["1", "2"], aliases={"canary": "1"}, pool="gpu")
    assert Route.model_validate_json(route.model_dump_json()) == route
    dv = _version("3")
    assert DeployedVersion.model_validate_json(dv.model_dump_json()) == dv
    assert _worker("w", {}, age_s=1).is_fresh(15)
    assert not _worker("w", {}, age_s=16).is_fresh(15)


def test_records_from_a_newer_registry_keep_serving() -> None:
    """Unknown config fields (a newer registry, mid-upgrade) are dropped, not the model."""
    import json as _json

    import pydantic
    import pytest as _pytest

    from inferbus_common.catalog import parse_deployed_version

    record = {
        "model": "fraud",
        "version": "3",
        "config": {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            "feature_from_the_future": {"on": True},
            "batching": {"max_queue_delay_us": 100, "also_new": 1},
        },
    }
    dv = parse_deployed_version(_json.dumps(record).encode())
    assert (dv.model, dv.version) == ("fraud", "3")
    assert dv.config.batching.max_queue_delay_us == 100
    record["config"]["inputs"] = "not a list"
    with _pytest.raises(pydantic.ValidationError):
        parse_deployed_version(_json.dumps(record).encode())


async def test_initial_values_ignore_a_marker_that_overtakes_the_entries(
    js: JetStreamContext,
) -> None:
    """The watcher's "initial values done" marker can arrive before entries the
    server already sent (its consumer-info reply overtakes them). `InitialValues`
    counts the bucket as loaded only once the entry at its last revision is in."""
    _, _, workers = await _buckets(js)
    for i in range(5):
        await workers.put(f"w{i}", _worker(f"w{i}", {}).model_dump_json().encode())
    watcher, initial = await InitialValues.watch(workers)
    try:
        assert initial.upto > 0
        assert not initial.see(None)  # the early marker: not loaded yet
        seen: list[str] = []
        while not initial.done:
            entry = await watcher.updates(timeout=WAIT)
            if entry is None:
                assert not initial.see(entry)
                continue
            seen.append(entry.key)
            assert initial.see(entry) == (len(seen) == 5), seen
        assert sorted(seen) == [f"w{i}" for i in range(5)]
        assert initial.see(None)  # stays loaded
    finally:
        await watcher.stop()

    empty = await ensure_kv(js, "ib_empty")
    watcher, initial = await InitialValues.watch(empty)
    try:
        assert initial.upto == 0 and initial.see(None)
    finally:
        await watcher.stop()
