"""Route writes through the registry API: compare-and-set, validation, audit events, and
catalog changes (push, alias) that keep the traffic split. Real registry, real NATS KV."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from inferbus_client.registry import RegistryClient
from inferbus_common import bus
from inferbus_common.catalog import Route
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_registry.app import RegistryApp


@pytest.fixture
async def nc(registry: RegistryApp) -> AsyncIterator[Client]:
    conn = await nats.connect(registry.settings.nats_url)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def two_versions(client: RegistryClient, make_version: Callable[..., Path]) -> str:
    """Model ``m`` with versions 1 (stable) and 2."""
    await client.push(make_version(), "m", "1", aliases=["stable"])
    await client.push(make_version(seed=0.25), "m", "2")
    return "m"


def _route(state: object) -> Route:
    return Route.model_validate_json(state.route_json)  # type: ignore[attr-defined]


async def test_set_traffic_records_who_when_why_and_publishes_an_event(
    client: RegistryClient, registry: RegistryApp, nc: Client, two_versions: str
) -> None:
    events = await nc.subscribe(registry.subjects.events("m"))
    await bus.sync(nc)
    before = await client.get_route("m")
    base = _route(before)
    assert base.stable == "1" and base.canary == "" and base.revision >= 1

    after = await client.set_traffic(
        "m",
        canary="2",
        canary_weight=10,
        shadow="2",
        shadow_rate=0.25,
        sticky="header:X-User-Id",
        updated_by="alice",
        change="try v2 on 10%",
        expected_kv_revision=before.kv_revision,
    )
    route = _route(after)
    assert (route.canary, route.canary_weight, route.shadow, route.shadow_rate) == (
        "2",
        10.0,
        "2",
        0.25,
    )
    assert route.sticky == "header:X-User-Id"
    assert route.revision == base.revision + 1
    assert route.updated_by == "alice" and route.change == "try v2 on 10%"
    assert route.updated_unix_ms > 0
    assert after.kv_revision > before.kv_revision

    # Every change is an event with who/when/what.
    for _ in range(10):
        event = json.loads((await events.next_msg(timeout=5)).data)
        if event["event"] == "route_changed":
            break
    assert event["revision"] == route.revision and event["updated_by"] == "alice"
    assert event["route"]["canary"] == "2" and event["previous_revision"] == base.revision

    # History from the KV bucket: the previous revision comes back.
    shown = await client.get_route("m", history=3)
    history = [Route.model_validate_json(h) for h in shown.history_json]
    assert history and history[0].revision == base.revision and history[0].canary == ""

    # Clearing: "none" removes the canary and its weight.
    cleared = _route(await client.set_traffic("m", canary="none", updated_by="alice"))
    assert cleared.canary == "" and cleared.canary_weight == 0.0
    assert cleared.shadow == "2"  # untouched fields keep their value
    assert cleared.revision == route.revision + 1


async def test_stale_revision_is_refused_with_route_changed(
    client: RegistryClient, two_versions: str
) -> None:
    read = await client.get_route("m")
    await client.set_traffic("m", canary="2", canary_weight=5, updated_by="bob")
    with pytest.raises(FailedPrecondition, match=r"route of 'm' changed.*re-read"):
        await client.set_traffic(
            "m", canary_weight=50, updated_by="carol", expected_kv_revision=read.kv_revision
        )
    assert _route(await client.get_route("m")).canary_weight == 5.0


async def test_concurrent_writers_each_get_their_own_revision(
    client: RegistryClient, two_versions: str
) -> None:
    start = _route(await client.get_route("m")).revision
    await client.set_traffic("m", canary="2", canary_weight=1, updated_by="init")
    results = await asyncio.gather(
        *(client.set_traffic("m", canary_weight=float(w), updated_by=f"w{w}") for w in range(2, 12))
    )
    revisions = sorted(_route(r).revision for r in results)
    final = _route(await client.get_route("m"))
    # No write was lost: eleven changes, eleven revisions after the start.
    assert final.revision == start + 11
    assert len(set(revisions)) == len(revisions)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"canary": "2", "canary_weight": 150.0}, InvalidArgument, "within 0-100"),
        ({"canary": "1", "canary_weight": 10.0}, InvalidArgument, "is the stable version"),
        ({"canary": "9", "canary_weight": 10.0}, NotFound, "no routable version '9'"),
        ({"shadow": "2", "shadow_rate": 1.5}, InvalidArgument, "within 0-1"),
        ({"canary_weight": 10.0}, InvalidArgument, "needs a canary version"),
        ({"sticky": "cookie"}, InvalidArgument, "sticky 'cookie' is not valid"),
    ],
)
async def test_invalid_changes_are_refused(
    client: RegistryClient,
    two_versions: str,
    kwargs: dict[str, object],
    error: type[Exception],
    text: str,
) -> None:
    before = _route(await client.get_route("m"))
    with pytest.raises(error, match=text):
        await client.set_traffic("m", updated_by="x", **kwargs)  # type: ignore[arg-type]
    assert _route(await client.get_route("m")).revision == before.revision


async def test_catalog_changes_keep_the_split_and_promotion_clears_the_canary(
    client: RegistryClient, make_version: Callable[..., Path], two_versions: str
) -> None:
    await client.set_traffic("m", canary="2", canary_weight=20, sticky="tenant", updated_by="a")
    split = _route(await client.get_route("m"))

    # A push moves `latest`: the catalog part changes, the split stays.
    await client.push(make_version(seed=0.75), "m", "3")
    after_push = _route(await client.get_route("m"))
    assert after_push.versions == ["1", "2", "3"]
    assert (after_push.canary, after_push.canary_weight, after_push.sticky) == ("2", 20.0, "tenant")
    assert after_push.revision == split.revision + 1 and after_push.updated_by == "registry"

    # Promoting the canary to stable leaves no canary behind.
    await client.set_alias("m", "stable", "2")
    promoted = _route(await client.get_route("m"))
    assert promoted.stable == "2" and promoted.canary == "" and promoted.canary_weight == 0.0
    assert promoted.sticky == "tenant"
    assert promoted.revision == after_push.revision + 1


async def test_republishing_an_unchanged_catalog_does_not_bump_the_revision(
    client: RegistryClient, registry: RegistryApp, two_versions: str
) -> None:
    from inferbus_registry.publisher import CatalogPublisher

    await client.set_traffic("m", canary="2", canary_weight=3, updated_by="a")
    before = await client.get_route("m")
    assert registry._nc is not None
    publisher = CatalogPublisher(registry._nc, registry.subjects)
    await publisher.republish_all(registry.repo)
    after = await client.get_route("m")
    assert after.kv_revision == before.kv_revision
    assert _route(after).canary_weight == 3.0


async def test_frozen_pool_refuses_new_traffic_but_allows_clearing(
    client: RegistryClient, two_versions: str
) -> None:
    await client.set_traffic("m", canary="2", canary_weight=5, updated_by="a")
    await client.set_pool("default", state="frozen", updated_by="ops")
    with pytest.raises(FailedPrecondition, match="pool 'default' is frozen"):
        await client.set_traffic("m", canary_weight=50, updated_by="a")
    cleared = _route(await client.set_traffic("m", canary="", updated_by="a"))
    assert cleared.canary == ""
    await client.set_pool("default", state="open", updated_by="ops")
    assert _route(await client.set_traffic("m", canary="2", canary_weight=5)).canary == "2"


async def test_revisions_keep_growing_across_an_unload_and_reload(
    client: RegistryClient, two_versions: str
) -> None:
    await client.set_traffic("m", canary="2", canary_weight=30, updated_by="a")
    before = _route(await client.get_route("m"))
    await client.set_serving("m", False, requested_by="ops")
    with pytest.raises(NotFound, match="has no route"):
        await client.get_route("m")
    await client.set_serving("m", True, requested_by="ops")
    after = _route(await client.get_route("m"))
    # A re-created route continues the numbering and starts without a split.
    assert after.revision > before.revision
    assert after.canary == "" and after.canary_weight == 0.0


async def test_the_routes_bucket_keeps_a_whole_rollout_of_history(
    client: RegistryClient, two_versions: str
) -> None:
    first = _route(await client.get_route("m")).revision
    for weight in range(1, 13):
        await client.set_traffic("m", canary="2", canary_weight=float(weight), updated_by="a")
    shown = await client.get_route("m", history=20)
    history = [Route.model_validate_json(h) for h in shown.history_json]
    # Twelve changes and the revisions before them are all still there (KV keeps 64).
    assert [h.revision for h in history][:12] == list(range(first + 11, first - 1, -1))
    assert history[-1].revision == 1


async def test_archived_versions_and_unloaded_models_take_no_traffic(
    client: RegistryClient, two_versions: str
) -> None:
    await client.archive("m", "2", requested_by="ops")
    for kwargs in ({"canary": "2", "canary_weight": 5.0}, {"shadow": "2", "shadow_rate": 0.5}):
        with pytest.raises(FailedPrecondition, match="'2' of 'm' is archived"):
            await client.set_traffic("m", updated_by="a", **kwargs)
    await client.unarchive("m", "2", requested_by="ops")
    await client.set_serving("m", False, requested_by="ops")
    with pytest.raises(FailedPrecondition, match=r"'m' is unloaded \(SetServing off\)"):
        await client.set_traffic("m", canary="2", canary_weight=5.0, updated_by="a")
    await client.set_serving("m", True, requested_by="ops")
    route = _route(await client.set_traffic("m", canary="2", canary_weight=5.0, updated_by="a"))
    assert (route.canary, route.canary_weight) == ("2", 5.0)


async def test_route_records_read_every_kept_record_every_time(registry_nats) -> None:
    """`route_records` against a real bucket: each of 200 reads of a removed route's
    three records sees all three in order (nats-py's `KeyValue.history` missed
    entries now and then, which restarted revisions after an unload)."""
    from inferbus_common.subjects import Subjects
    from inferbus_registry.traffic import route_records

    subjects = Subjects(prefix="rr")
    conn = await nats.connect(registry_nats.url)
    try:
        js = conn.jetstream()
        kv = await js.create_key_value(bucket=subjects.routes_bucket, history=64)
        key = subjects.model_key("m")
        for revision in (1, 2, 3):
            await kv.put(
                key, Route(model="m", stable="1", revision=revision).model_dump_json().encode()
            )
        await kv.put(
            subjects.model_key("other"), Route(model="other", stable="1").model_dump_json().encode()
        )
        await kv.delete(key)
        for _ in range(200):
            assert [r.revision for r in await route_records(js, subjects, "m")] == [1, 2, 3]
        assert await route_records(js, subjects, "never-routed") == []
        await js.delete_key_value(subjects.routes_bucket)
    finally:
        await conn.close()
