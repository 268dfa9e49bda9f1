"""Archive, unarchive, delete and serving on a real registry (real NATS, local store).

Every change is checked where other services see it: the store, the catalog
in NATS KV and the lifecycle events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client

from inferbus_client.registry import RegistryClient
from inferbus_common.catalog import Route
from inferbus_common.errors import FailedPrecondition, NotFound
from inferbus_registry.app import RegistryApp


@pytest.fixture
async def nc(registry: RegistryApp) -> AsyncIterator[Client]:
    conn = await nats.connect(registry.settings.nats_url)
    try:
        yield conn
    finally:
        await conn.close()


async def _route(nc: Client, registry: RegistryApp, model: str) -> Route | None:
    kv = await nc.jetstream().key_value(registry.subjects.routes_bucket)
    try:
        entry = await kv.get(registry.subjects.model_key(model))
    except nats.js.errors.KeyNotFoundError:
        return None
    return Route.model_validate_json(entry.value) if entry.value else None


async def _deployed(nc: Client, registry: RegistryApp, model: str, version: str) -> bool:
    kv = await nc.jetstream().key_value(registry.subjects.models_bucket)
    try:
        entry = await kv.get(registry.subjects.model_key(model, version))
    except nats.js.errors.KeyNotFoundError:
        return False
    return bool(entry.value)


async def _event(sub, name: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The next event called `name`, skipping push events still in flight.

    The registry publishes without flushing, so a push's event may reach a
    subscription made right after the push returned.
    """
    while True:
        event = json.loads((await sub.next_msg(timeout=5)).data)
        if event["event"] == name or event["event"] != "version_pushed":
            return event


async def test_archive_refusals_and_round_trip(
    client: RegistryClient, registry: RegistryApp, nc: Client, make_version: Callable[..., Path]
) -> None:
    await client.push(make_version(), "fraud", "1.0.0")  # stable
    await client.push(make_version(seed=0.25), "fraud", "1.5.0", aliases=["canary"])
    await client.push(make_version(seed=0.75), "fraud", "2.0.0")  # latest
    events = await nc.subscribe(registry.subjects.events("fraud"))

    with pytest.raises(FailedPrecondition, match=r"alias 'stable'"):
        await client.archive("fraud", "1.0.0")
    with pytest.raises(FailedPrecondition, match=r"alias 'canary'"):
        await client.archive("fraud", "1.5.0")
    with pytest.raises(FailedPrecondition, match=r"alias 'canary'"):
        await client.delete_version("fraud", "1.5.0")
    with pytest.raises(NotFound):
        await client.archive("fraud", "9.9.9")

    # `latest` is no reason to refuse: it moves to the highest active version.
    info = await client.archive("fraud", "2.0.0", requested_by="alice")
    assert list(info.archived) == ["2.0.0"]
    assert list(info.versions) == ["1.0.0", "1.5.0", "2.0.0"]  # files kept
    assert dict(info.aliases)["latest"] == "1.5.0"
    event = await _event(events, "version_archived")
    assert event["event"] == "version_archived" and event["version"] == "2.0.0"
    assert event["requested_by"] == "alice"
    assert not await _deployed(nc, registry, "fraud", "2.0.0")
    route = await _route(nc, registry, "fraud")
    assert route is not None and route.versions == ["1.0.0", "1.5.0"]
    assert route.aliases["latest"] == "1.5.0"
    assert await registry.store.exists("models/fraud/2.0.0/model.onnx")
    assert (await client.get_version("fraud", "2.0.0")).archived

    # An archived version cannot be aliased (or promoted by a push) until unarchived.
    with pytest.raises(FailedPrecondition, match="unarchive"):
        await client.set_alias("fraud", "stable", "2.0.0")
    again = await client.archive("fraud", "2.0.0")  # idempotent: republishes, same event
    assert list(again.archived) == ["2.0.0"]
    assert (await _event(events, "version_archived"))["event"] == "version_archived"

    info = await client.unarchive("fraud", "2.0.0")
    assert list(info.archived) == [] and dict(info.aliases)["latest"] == "2.0.0"
    event = await _event(events, "version_unarchived")
    assert event["event"] == "version_unarchived"
    assert await _deployed(nc, registry, "fraud", "2.0.0")
    await client.set_alias("fraud", "canary", "2.0.0")
    assert (await client.get_version("fraud", "2.0.0")).archived is False


async def test_delete_removes_files_and_catalog_entry(
    client: RegistryClient, registry: RegistryApp, nc: Client, make_version: Callable[..., Path]
) -> None:
    await client.push(make_version(), "churn", "1")
    await client.push(make_version(seed=0.3), "churn", "2", aliases=["stable"])
    events = await nc.subscribe(registry.subjects.events("churn"))
    with pytest.raises(FailedPrecondition, match="stable"):
        await client.delete_version("churn", "2")

    info = await client.delete_version("churn", "1", requested_by="ops")
    assert list(info.versions) == ["2"]
    event = await _event(events, "version_deleted")
    assert event["event"] == "version_deleted" and event["version"] == "1"
    assert event["bytes_freed"] > 0
    assert await registry.store.list("models/churn/1/") == []
    assert not (registry.settings.store_dir / "models" / "churn" / "1").exists()
    assert (registry.settings.store_dir / "models" / "churn" / "2").is_dir()
    assert not await _deployed(nc, registry, "churn", "1")
    route = await _route(nc, registry, "churn")
    assert route is not None and route.versions == ["2"]
    with pytest.raises(NotFound):
        await client.get_version("churn", "1")
    # The number can be pushed again (with other content) after a delete.
    await client.push(make_version(seed=0.9), "churn", "1")
    assert [m.versions for m in await client.list_models() if m.name == "churn"] == [["1", "2"]]


async def test_unload_withdraws_the_route_and_load_restores_it(
    client: RegistryClient, registry: RegistryApp, nc: Client, make_version: Callable[..., Path]
) -> None:
    await client.push(make_version(), "fraud", "1")
    await client.push(make_version(seed=0.2), "fraud", "2")
    events = await nc.subscribe(registry.subjects.events("fraud"))

    info = await client.set_serving("fraud", False, requested_by="triton")
    assert info.unloaded and dict(info.aliases)["stable"] == "1"  # aliases kept
    assert (await _event(events, "model_unloaded"))["event"] == "model_unloaded"
    assert await _route(nc, registry, "fraud") is None
    assert await _deployed(nc, registry, "fraud", "1")  # the artifact stays published

    # A restart keeps it unloaded (the marker lives in the store).
    await registry.__aexit__(None, None, None)
    async with RegistryApp(registry.settings) as again:
        async with RegistryClient(f"127.0.0.1:{again.grpc_port}") as c2:
            assert (await c2.list_models())[0].unloaded
            assert await _route(nc, again, "fraud") is None
            info = await c2.set_serving("fraud", True, "2")
            assert not info.unloaded and dict(info.aliases)["stable"] == "2"
            route = await _route(nc, again, "fraud")
            assert route is not None and route.stable == "2"
            await c2.archive("fraud", "1")
            with pytest.raises(FailedPrecondition, match="archived"):
                await c2.set_serving("fraud", True, "1")


async def test_canary_and_shadow_of_the_live_route_block_archive_and_delete(
    client: RegistryClient, make_version: Callable[..., Path]
) -> None:
    await client.push(make_version(), "fraud", "1")  # stable
    await client.push(make_version(seed=0.2), "fraud", "2")
    await client.push(make_version(seed=0.3), "fraud", "3")  # latest
    await client.set_traffic("fraud", canary="2", canary_weight=10)
    await client.set_traffic("fraud", shadow="3", shadow_rate=0.5)
    with pytest.raises(FailedPrecondition, match=r"route\.canary"):
        await client.archive("fraud", "2")
    with pytest.raises(FailedPrecondition, match=r"route\.shadow"):
        await client.delete_version("fraud", "3")
    await client.set_traffic("fraud", canary="", shadow="")
    assert list((await client.archive("fraud", "2")).archived) == ["2"]
    assert list((await client.delete_version("fraud", "3")).versions) == ["1", "2"]
