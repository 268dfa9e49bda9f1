"""Publishing the repository to the bus: catalog records in KV and lifecycle events.

The object store is the source of truth; NATS KV is a copy that every
service watches. So every write here is idempotent, and on start-up the
registry republishes everything (a fresh NATS gets the catalog back).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from inferbus_common.bus import NO_STREAM_ERRORS, sync
from inferbus_common.catalog import Route, ensure_kv
from inferbus_common.subjects import Subjects
from inferbus_registry import metrics
from inferbus_registry.records import ModelState, VersionRecord
from inferbus_registry.repository import ModelRepository
from inferbus_registry.traffic import (
    Ready,
    RouteWrite,
    cas_write,
    hold_stable,
    merge_catalog,
    now_ms,
    read_route,
    route_event_fields,
)

log = logging.getLogger(__name__)


class CatalogPublisher:
    """Writes `DeployedVersion` and `Route` records and publishes registry events.

    Args:
        nc: a connected NATS client.
        subjects: naming scheme.
        ready: (model, version) → a live worker serves it; with it, a catalog write
            that moves ``stable`` is held until the new version is ready
            (`traffic.hold_stable`); None: no hold (no view of the workers).
    """

    def __init__(self, nc: Client, subjects: Subjects, *, ready: Ready | None = None) -> None:
        self._nc = nc
        self._subjects = subjects
        self.ready = ready
        self._models: KeyValue | None = None
        self._routes: KeyValue | None = None

    def jetstream(self) -> JetStreamContext:
        """A JetStream context on the publisher's connection."""
        return self._nc.jetstream()

    @property
    def subjects(self) -> Subjects:
        """The naming scheme it publishes under."""
        return self._subjects

    async def open(self) -> None:
        """Open (creating when needed) the models and routes KV buckets."""
        js = self._nc.jetstream()
        self._models = await ensure_kv(js, self._subjects.models_bucket)
        self._routes = await ensure_kv(js, self._subjects.routes_bucket)

    def _kv(self) -> tuple[KeyValue, KeyValue]:
        if self._models is None or self._routes is None:
            raise RuntimeError("CatalogPublisher.open() was not awaited")
        return self._models, self._routes

    async def publish_version(self, record: VersionRecord) -> None:
        """Write the version's `DeployedVersion` into the models bucket.

        A version's drift profile goes into the profiles bucket first, so a
        gateway that sees `DeployedVersion.has_profile` finds it there.
        """
        key = self._subjects.model_key(record.model, record.version)
        if record.profile_json:
            await self._put_profile(key, record.profile_json)
        await self._put(0, key, record.deployed().model_dump_json().encode())

    async def _put_profile(self, key: str, value: bytes) -> None:
        """Write a ``profile.json`` into the profiles bucket (re-created when missing)."""
        js = self._nc.jetstream()
        try:
            kv = await ensure_kv(js, self._subjects.profiles_bucket, history=1)
            await kv.put(key, value)
        except NO_STREAM_ERRORS:
            kv = await ensure_kv(js, self._subjects.profiles_bucket, history=1)
            await kv.put(key, value)

    async def publish_route(self, repo: ModelRepository, state: ModelState) -> None:
        """Write the model's `Route` into the routes bucket (once it has ``stable``)."""
        route = await repo.route(state)
        if route is None:
            if state.unloaded or not state.versions:
                # Unloaded or gone: withdraw the route so workers unload it.
                await self.remove_route(state.name)
            return
        ready = self.ready
        now = now_ms()

        def mutate(current: Route | None) -> Route:
            merged = merge_catalog(route, current)
            return merged if ready is None else hold_stable(merged, current, ready, now)

        # The catalog change has its own event (version_pushed, alias_set, ...).
        await self.write_route(state.name, mutate, updated_by="registry", publish_event=False)

    async def routes_kv(self) -> KeyValue:
        """The routes bucket (opened when needed)."""
        if self._routes is None:
            await self.open()
        return self._kv()[1]

    async def write_route(
        self,
        model: str,
        mutate: Callable[[Route | None], Route | None],
        *,
        updated_by: str,
        change: str = "",
        expected_kv_revision: int = 0,
        publish_event: bool = True,
    ) -> RouteWrite:
        """Compare-and-set a model's route (`traffic.cas_write`) and publish ``route_changed``.

        The catalog part comes from the store, the traffic part (canary,
        shadow, stickiness) only lives in KV; every writer goes through here
        so no write loses another's fields and every change is an event.
        """

        writer = "traffic"
        if updated_by == "registry":
            writer = "catalog"
        elif updated_by.startswith("rollout "):
            writer = "rollout"

        async def announce(write: RouteWrite) -> None:
            metrics.ROUTE_CHANGES.labels(writer).inc()
            if publish_event:
                await self.event(model, "route_changed", **route_event_fields(write))

        async def write(kv: KeyValue) -> RouteWrite:
            return await cas_write(
                kv,
                self._subjects,
                model,
                mutate,
                js=self.jetstream(),
                updated_by=updated_by,
                change=change,
                expected_kv_revision=expected_kv_revision,
                on_change=announce,
            )

        try:
            return await write(await self.routes_kv())
        except NO_STREAM_ERRORS:
            log.warning("routes bucket missing on NATS; re-creating it")
            await self.open()
            return await write(self._kv()[1])

    async def current_route(self, model: str) -> Route | None:
        """The model's route as routers see it now (traffic part included)."""
        route, _ = await read_route(await self.routes_kv(), self._subjects, model)
        return route

    async def unpublish_version(self, model: str, version: str) -> None:
        """Remove a version's `DeployedVersion` (archived or deleted; idempotent)."""
        await self._delete(0, self._subjects.model_key(model, version))

    async def remove_route(self, model: str) -> None:
        """Remove a model's `Route` (unloaded or deleted; idempotent)."""
        await self._delete(1, self._subjects.model_key(model))

    async def _delete(self, which: int, key: str) -> None:
        try:
            await self._kv()[which].delete(key)
        except nats.js.errors.KeyNotFoundError:
            pass
        except NO_STREAM_ERRORS:
            # A bucket that is gone holds no key to delete; re-create it for later writes.
            await self.open()

    async def _put(self, which: int, key: str, value: bytes) -> None:
        try:
            await self._kv()[which].put(key, value)
        except NO_STREAM_ERRORS:
            # The bucket's stream is gone (a NATS server that lost its state):
            # create it again and retry once.
            log.warning("catalog bucket missing on NATS; re-creating it")
            await self.open()
            await self._kv()[which].put(key, value)

    async def event(self, model: str, event: str, **fields: Any) -> None:
        """Publish ``{"event": event, "model": model, ...}`` on the model's events subject."""
        body = json.dumps({"event": event, "model": model, **fields}).encode()
        await self._nc.publish(self._subjects.events(model), body)

    async def republish_all(self, repo: ModelRepository) -> int:
        """Write every stored version and route into KV; returns the number of versions.

        The buckets are opened again first: after a NATS server lost its state
        they must be re-created before anything can be written.
        """
        await self.open()
        count = 0
        for state in await repo.list_models():
            for version in state.versions:
                if version in state.archived:
                    await self.unpublish_version(state.name, version)
                    continue
                await self.publish_version(await repo.get_version(state.name, version))
                count += 1
            await self.publish_route(repo, state)
        await sync(self._nc)
        log.info("catalog republished: %d version(s)", count)
        return count
