"""Publishing the repository to the bus: catalog records in KV and lifecycle events.

The object store is the source of truth; NATS KV is a copy that every
service watches. So every write here is idempotent, and on start-up the
registry republishes everything (a fresh NATS gets the catalog back).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from inferbus_common.catalog import ensure_kv
from inferbus_common.subjects import Subjects
from inferbus_registry.repository import ModelRepository, ModelState, VersionRecord

log = logging.getLogger(__name__)


class CatalogPublisher:
    """Writes `DeployedVersion` and `Route` records and publishes registry events.

    Args:
        nc: a connected NATS client.
        subjects: naming scheme.
    """

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects
        self._models: KeyValue | None = None
        self._routes: KeyValue | None = None

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
        """Write the version's `DeployedVersion` into the models bucket."""
        key = self._subjects.model_key(record.model, record.version)
        await self._put(0, key, record.deployed().model_dump_json().encode())

    async def publish_route(self, repo: ModelRepository, state: ModelState) -> None:
        """Write the model's `Route` into the routes bucket (once it has ``stable``)."""
        route = await repo.route(state)
        if route is None:
            return
        await self._put(1, self._subjects.model_key(state.name), route.model_dump_json().encode())

    async def _put(self, which: int, key: str, value: bytes) -> None:
        try:
            await self._kv()[which].put(key, value)
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
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
                await self.publish_version(await repo.get_version(state.name, version))
                count += 1
            await self.publish_route(repo, state)
        await self._nc.flush()
        log.info("catalog republished: %d version(s)", count)
        return count
