"""What is deployed, where, and who serves it: records kept in NATS KV.

Three buckets (names from `Subjects`):

* ``<prefix>_models``  key ``<model>.<version>`` → `DeployedVersion`
  (config, artifact digest and files), written by the registry.
* ``<prefix>_routes``  key ``<model>`` → `Route` (stable version, aliases,
  pool), written by the registry, read by the router and gateway.
* ``<prefix>_workers`` key ``<worker id>`` → `WorkerStatus` heartbeat,
  written by each worker every few seconds.

`Catalog` watches all three and keeps an in-memory copy that follows changes
live; every service that needs to know what is deployed holds one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field, ValidationError

from inferbus_common.modelconfig import ModelConfig
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)


class DeployedVersion(BaseModel):
    """A model version the registry has stored and published."""

    model: str
    version: str
    config: ModelConfig
    digest: str = ""
    """SHA-256 of the version's manifest.json."""
    files: dict[str, str] = Field(default_factory=dict)
    """Path inside the version → SHA-256 of the file."""
    created_unix_ms: int = 0
    signature: str = ""
    """Base64 Ed25519 signature of `signing.signed_payload` (empty: unsigned)."""
    key_id: str = ""
    """Which registry key signed it."""


class Route(BaseModel):
    """Routing table of one model."""

    model: str
    stable: str
    """Version that serves requests that pin none."""
    versions: list[str] = Field(default_factory=list)
    aliases: dict[str, str] = Field(default_factory=dict)
    pool: str = "default"
    """Pool of the stable version (each version's own pool is its `config.pool`)."""
    canary: str = ""
    """Version that takes `canary_weight` percent of unpinned traffic ('' = none)."""
    canary_weight: float = 0.0
    """Percent (0-100) of unpinned requests sent to `canary`."""
    shadow: str = ""
    """Version that receives sampled copies of requests ('' = none); never answers clients."""
    shadow_rate: float = 0.0
    """Fraction (0-1) of requests copied to `shadow`."""
    sticky: str = ""
    """Stickiness key: '' (off), 'tenant', or 'header:<Name>' (a request header)."""
    revision: int = 0
    """Incremented by every change; routers log and export it."""
    updated_by: str = ""
    updated_unix_ms: int = 0
    change: str = ""
    """Why the last change was made (operator text or rollout step)."""


class WorkerStatus(BaseModel):
    """A worker's heartbeat."""

    worker_id: str
    pool: str
    models: dict[str, str] = Field(default_factory=dict)
    """``"<model>/<version>"`` → ``ready`` | ``loading`` | ``failed: <reason>``."""
    ts_ms: int = 0
    """Wall-clock time of the heartbeat."""
    host: str = ""
    pid: int = 0

    def is_fresh(self, max_age_s: float) -> bool:
        """Whether the heartbeat is recent enough to trust."""
        return (time.time() * 1000 - self.ts_ms) <= max_age_s * 1000


async def ensure_kv(js: JetStreamContext, bucket: str, *, history: int = 5) -> KeyValue:
    """Open a KV bucket, creating it when it does not exist yet."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_key_value(bucket=bucket, history=history)
        except nats.js.errors.BadRequestError:
            return await js.key_value(bucket)


class Catalog:
    """Live, in-memory view of the three catalog buckets.

    Use as an async context manager; `wait_loaded` returns once the initial
    contents of every bucket have been read.

    Args:
        js: JetStream context of a connected client.
        subjects: naming scheme.
        heartbeat_max_age_s: a worker whose heartbeat is older is ignored.
        on_change: optional callback run after any update.
    """

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        heartbeat_max_age_s: float = 15.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self._max_age = heartbeat_max_age_s
        self._on_change = on_change
        self.versions: dict[tuple[str, str], DeployedVersion] = {}
        self.routes: dict[str, Route] = {}
        self.workers: dict[str, WorkerStatus] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loaded: list[asyncio.Event] = []
        self._changed = asyncio.Condition()

    async def __aenter__(self) -> Catalog:
        for bucket, apply in (
            (self._subjects.models_bucket, self._apply_version),
            (self._subjects.routes_bucket, self._apply_route),
            (self._subjects.workers_bucket, self._apply_worker),
        ):
            kv = await ensure_kv(self._js, bucket)
            loaded = asyncio.Event()
            self._loaded.append(loaded)
            watcher = await kv.watchall()
            self._tasks.append(asyncio.create_task(self._follow(watcher, apply, loaded)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a watcher blocked in a nats-py call that lost its
            # cancellation must not hold up the shutdown of the whole service.
            _, pending = await asyncio.wait(self._tasks, timeout=5.0)
            if pending:
                log.warning("%d catalog watchers did not stop in time", len(pending))
        self._tasks.clear()

    async def wait_loaded(self, timeout: float = 10.0) -> None:
        """Wait until the initial contents of every bucket are in memory."""
        async with asyncio.timeout(timeout):
            for ev in self._loaded:
                await ev.wait()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds after some update; False on timeout."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(predicate)
                return True
        except TimeoutError:
            return False

    async def _follow(
        self,
        watcher: KeyValue.KeyWatcher,
        apply: Callable[[str, bytes | None], None],
        loaded: asyncio.Event,
    ) -> None:
        try:
            async for entry in watcher:
                if entry is None:
                    loaded.set()
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                try:
                    apply(entry.key, None if deleted else entry.value)
                except (ValidationError, ValueError) as exc:
                    log.warning("ignoring malformed catalog entry %s: %s", entry.key, exc)
                if self._on_change is not None:
                    self._on_change()
                async with self._changed:
                    self._changed.notify_all()
        finally:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(2.0):
                    await watcher.stop()

    def _apply_version(self, key: str, value: bytes | None) -> None:
        if value is None:
            for k, v in list(self.versions.items()):
                if self._subjects.model_key(v.model, v.version) == key:
                    del self.versions[k]
            return
        dv = DeployedVersion.model_validate_json(value)
        self.versions[(dv.model, dv.version)] = dv

    def _apply_route(self, key: str, value: bytes | None) -> None:
        if value is None:
            for name in [n for n in self.routes if self._subjects.model_key(n) == key]:
                del self.routes[name]
            return
        route = Route.model_validate_json(value)
        self.routes[route.model] = route

    def _apply_worker(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.workers.pop(key, None)
            return
        ws = WorkerStatus.model_validate_json(value)
        self.workers[key] = ws

    # --- queries -------------------------------------------------------------
    def resolve(self, model: str, version: str = "") -> DeployedVersion | None:
        """The deployed version a request for (`model`, `version`) means.

        An empty version means the route's stable version; an alias name is
        resolved through the route's aliases.
        """
        route = self.routes.get(model)
        if not version:
            if route is None:
                return None
            version = route.stable
        elif route is not None and version in route.aliases:
            version = route.aliases[version]
        return self.versions.get((model, version))

    def ready_workers(self, model: str, version: str) -> list[WorkerStatus]:
        """Live workers that report (`model`, `version`) ready."""
        key = f"{model}/{version}"
        return [
            w
            for w in self.workers.values()
            if w.models.get(key) == "ready" and w.is_fresh(self._max_age)
        ]

    def version_state(self, model: str, version: str) -> str:
        """``ready`` if a live worker serves it, else the most telling worker state."""
        key = f"{model}/{version}"
        states = [
            w.models[key]
            for w in self.workers.values()
            if key in w.models and w.is_fresh(self._max_age)
        ]
        if "ready" in states:
            return "ready"
        failed = [s for s in states if s.startswith("failed")]
        if failed:
            return failed[0]
        if states:
            return states[0]
        return "no worker"
