"""What is deployed, where, and who serves it: records kept in NATS KV.

Four buckets (names from `Subjects`):

* ``<prefix>_models``  key ``<model>.<version>`` → `DeployedVersion`
  (config, artifact digest and files), written by the registry.
* ``<prefix>_routes``  key ``<model>`` → `Route` (stable version, aliases,
  pool), written by the registry, read by the router and gateway.
* ``<prefix>_workers`` key ``<worker id>`` → `WorkerStatus` heartbeat,
  written by each worker every few seconds.
* ``<prefix>_pools``   key ``<pool>`` → `PoolSpec` (quota, release state),
  written by the registry (``inferbus pools set``), read by workers.

`Catalog` watches all four and keeps an in-memory copy that follows changes
live; every service that needs to know what is deployed holds one. The
records are defined in `inferbus_common.catalogrecords` (the three most used
are importable from here too), a pool's quota rules in
`inferbus_common.poolquota`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import ValidationError

from inferbus_common.bus import replicas_of
from inferbus_common.catalogrecords import (
    READY,
    DeployedVersion,
    PoolSpec,
    Route,
    WorkerStatus,
    summarize_states,
)
from inferbus_common.errors import NotFound
from inferbus_common.kvwatch import InitialValues
from inferbus_common.modelstats import ModelStats
from inferbus_common.resolver import pinned_version
from inferbus_common.subjects import Subjects
from inferbus_common.versionnumbers import integer_version

log = logging.getLogger(__name__)

__all__ = [
    "Catalog",
    "DeployedVersion",
    "Route",
    "WorkerStatus",
    "ensure_kv",
    "parse_deployed_version",
]


def parse_deployed_version(value: bytes) -> DeployedVersion:
    """A catalog record, tolerating fields this release does not know.

    `ModelConfig` forbids unknown keys so that a typo in a pushed config.json is
    refused at upload. A catalog record, though, may come from a *newer* registry
    during a rolling upgrade; dropping the whole model for a field we cannot use
    would take it out of service. So unknown keys are removed (with a warning)
    and the record is read again; any other error still raises.

    Raises:
        ValidationError, ValueError: the record is malformed in another way.
    """
    try:
        return DeployedVersion.model_validate_json(value)
    except ValidationError as exc:
        errors = exc.errors()
        if not errors or any(e["type"] != "extra_forbidden" for e in errors):
            raise
        data = json.loads(value)
        for err in errors:
            *path, last = err["loc"]
            node = data
            for part in path:
                node = node[part]
            node.pop(last, None)
        log.warning(
            "catalog record has fields this release does not know (newer registry?): %s; "
            "ignoring them",
            ", ".join(".".join(map(str, e["loc"])) for e in errors),
        )
        return DeployedVersion.model_validate(data)


async def ensure_kv(js: JetStreamContext, bucket: str, *, history: int = 5) -> KeyValue:
    """Open a KV bucket, creating it when it does not exist yet.

    A new bucket gets the replica count of the connection
    (`inferbus_common.bus.replicas_of`); an existing one keeps its own.
    """
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_key_value(
                bucket=bucket, history=history, replicas=replicas_of(js)
            )
        except nats.js.errors.BadRequestError:
            return await js.key_value(bucket)


# What JetStream answers while a stream has no leader (an election on a cluster).
_NOT_ANSWERING = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)


class Catalog:
    """Live, in-memory view of the four catalog buckets.

    Use as an async context manager; `wait_loaded` returns once the initial
    contents of every bucket have been read.

    Args:
        js: JetStream context of a connected client.
        subjects: naming scheme.
        heartbeat_max_age_s: a worker whose heartbeat is older is ignored.
        on_change: optional callback run after any update.
        probe_interval_s: on a cluster, how often each watcher's consumer is
            checked (see `_keep_watching`).
        start_timeout_s: how long opening the buckets is retried while
            JetStream does not answer (a leader election on a cluster).
    """

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        *,
        heartbeat_max_age_s: float = 15.0,
        on_change: Callable[[], None] | None = None,
        probe_interval_s: float = 1.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self._max_age = heartbeat_max_age_s
        self._on_change = on_change
        self._probe_interval_s = probe_interval_s
        self.lost_watches = 0
        """Buckets watched again because their watcher's consumer was found gone."""
        self._start_timeout_s = start_timeout_s
        self.versions: dict[tuple[str, str], DeployedVersion] = {}
        self.routes: dict[str, Route] = {}
        self.workers: dict[str, WorkerStatus] = {}
        self.pools: dict[str, PoolSpec] = {}
        # bucket -> (its watcher, the task following it)
        self._watches: dict[str, tuple[KeyValue.KeyWatcher, asyncio.Task[None]]] = {}
        # Tasks of replaced watchers, still stopping them.
        self._retiring: set[asyncio.Task[None]] = set()
        self._guard_task: asyncio.Task[None] | None = None
        self._loaded: list[asyncio.Event] = []
        self._changed = asyncio.Condition()

    def _buckets(self) -> list[tuple[str, Callable[[str, bytes | None], None]]]:
        return [
            (self._subjects.models_bucket, self._apply_version),
            (self._subjects.routes_bucket, self._apply_route),
            (self._subjects.workers_bucket, self._apply_worker),
            (self._subjects.pools_bucket, self._apply_pool),
        ]

    async def __aenter__(self) -> Catalog:
        for bucket, apply in self._buckets():
            loaded = asyncio.Event()
            self._loaded.append(loaded)
            await self._first_watch(bucket, apply, loaded)
        self._guard_task = asyncio.create_task(self._keep_watching())
        return self

    async def _first_watch(
        self, bucket: str, apply: Callable[[str, bytes | None], None], loaded: asyncio.Event
    ) -> None:
        """`_watch`, retried for `start_timeout_s` while JetStream cannot answer.

        On a cluster that has just lost a node, a bucket's stream has no leader
        for the few seconds of an election: its info request times out or finds
        no responder. A service starting then waits instead of exiting.
        """
        deadline = asyncio.get_running_loop().time() + self._start_timeout_s
        while True:
            try:
                await self._watch(bucket, apply, loaded)
                return
            except _NOT_ANSWERING as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("catalog: bucket %s not available yet (%r); retrying", bucket, exc)
                await asyncio.sleep(0.5)

    async def _watch(
        self, bucket: str, apply: Callable[[str, bytes | None], None], loaded: asyncio.Event
    ) -> None:
        """Watch `bucket` (afresh), replacing the watch it had."""
        kv = await ensure_kv(self._js, bucket)
        watcher, initial = await InitialValues.watch(kv)
        task = asyncio.create_task(self._follow(watcher, apply, loaded, initial))
        old = self._watches.get(bucket)
        self._watches[bucket] = (watcher, task)
        if old is not None:
            # Its task stops the old watcher on the way out (bounded, but a
            # dead node can make that take seconds: not waited for here).
            old[1].cancel()
            self._retiring.add(old[1])
            old[1].add_done_callback(self._retiring.discard)

    async def _watch_lost(self, watcher: KeyValue.KeyWatcher) -> bool:
        """Whether the server no longer serves this watcher's consumer.

        A watcher is an ephemeral consumer with one replica, on one node of a
        cluster. When that node dies the client stays connected to its own
        node and nats-py notices only after two missed idle heartbeats (10-20
        s), meanwhile worker heartbeats seemed to stop. Asking for the
        consumer's info tells within a second: no answer, or no consumer.
        """
        try:
            # KeyWatcher keeps its subscription private; nats-py has no public handle.
            await asyncio.wait_for(
                watcher._sub.consumer_info(),  # type: ignore[union-attr]  # set once watching
                self._probe_interval_s,
            )
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return True
        except nats.js.errors.NotFoundError:
            return True
        except (nats.errors.Error, nats.js.errors.Error, OSError):
            return False  # not a verdict on the consumer (e.g. a reconnect under way)
        return False

    async def _keep_watching(self) -> None:
        """Watch a bucket afresh whenever its watcher may have lost its consumer.

        After a reconnect every bucket is watched again: a restarted
        nats-server no longer has the watchers' consumers. On a cluster (the
        client knows more than one server) each watcher's consumer is also
        probed every `probe_interval_s`, and a bucket whose consumer is gone
        (its node died) is watched again at once. A new watcher replays the
        current value of every key, so nothing missed stays missed.
        """
        nc = self._js._nc  # the JetStream context's connection (nats-py has no public handle)
        seen = nc.stats.get("reconnects", 0)
        next_probe = asyncio.get_running_loop().time() + self._probe_interval_s
        while True:
            await asyncio.sleep(0.25)
            if not nc.is_connected:
                continue
            now = nc.stats.get("reconnects", 0)
            lost: list[str] = []
            why = ""
            if now != seen:
                lost, why = [b for b, _ in self._buckets()], "a NATS reconnect"
            elif len(nc.servers) > 1 and asyncio.get_running_loop().time() >= next_probe:
                next_probe = asyncio.get_running_loop().time() + self._probe_interval_s
                for bucket, (watcher, _task) in list(self._watches.items()):
                    if await self._watch_lost(watcher):
                        lost.append(bucket)
                why = "its consumer was lost (a NATS node went away)"
                self.lost_watches += len(lost)
            if not lost:
                continue
            try:
                for bucket, apply in self._buckets():
                    if bucket in lost:
                        await self._watch(bucket, apply, asyncio.Event())
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                log.warning("catalog: re-watch failed (%s); retrying", exc)
                continue
            seen = now
            log.info("catalog: watching %s again after %s", ", ".join(lost), why)

    async def __aexit__(self, *exc: object) -> None:
        if self._guard_task is not None:
            self._guard_task.cancel()
            await asyncio.wait([self._guard_task], timeout=5.0)
            self._guard_task = None
        tasks = [task for _watcher, task in self._watches.values()] + list(self._retiring)
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a watcher blocked in a nats-py call that lost its
            # cancellation must not hold up the shutdown of the whole service.
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            if pending:
                log.warning("%d catalog watchers did not stop in time", len(pending))
        self._watches.clear()

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
        initial: InitialValues,
    ) -> None:
        try:
            async for entry in watcher:
                if entry is None:
                    if initial.see(entry):
                        loaded.set()
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                try:
                    apply(entry.key, None if deleted else entry.value)
                except (ValidationError, ValueError) as exc:
                    log.warning("ignoring malformed catalog entry %s: %s", entry.key, exc)
                if initial.see(entry):
                    loaded.set()
                if self._on_change is not None:
                    self._on_change()
                async with self._changed:
                    self._changed.notify_all()
        finally:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(2.0):
                    await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py: unannotated

    def _apply_version(self, key: str, value: bytes | None) -> None:
        if value is None:
            for k, v in list(self.versions.items()):
                if self._subjects.model_key(v.model, v.version) == key:
                    del self.versions[k]
            return
        dv = parse_deployed_version(value)
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

    def _apply_pool(self, key: str, value: bytes | None) -> None:
        if value is None:
            for name in [n for n in self.pools if self._subjects.model_key(n) == key]:
                del self.pools[name]
            return
        spec = PoolSpec.model_validate_json(value)
        self.pools[spec.name] = spec

    # --- queries -------------------------------------------------------------
    def deployed(
        self, model: str, pin: str = "", numbers: Mapping[str, str] | None = None
    ) -> DeployedVersion:
        """The deployed version a request for (`model`, `pin`) means.

        The pin (a version, an alias, ``stable``/``canary``, a version number,
        or '' for the route's stable version) is read by
        `resolver.pinned_version`, the rule the router applies too; an integer
        pin that names no version is looked up among the model's numbers
        (`numbers`) unless the caller brings its own.

        Raises:
            NotFound: the model has no route, the pin names nothing, or the
                version it names has no record in the models bucket.
        """
        if numbers is None and integer_version(pin) is not None:
            numbers = self.numbers(model)
        version = pinned_version(self.routes.get(model), model, pin, numbers)
        dv = self.versions.get((model, version))
        if dv is None:
            raise NotFound(f"model '{model}' version '{version}' is not deployed")
        return dv

    def numbers(self, model: str) -> dict[str, str]:
        """`model`'s version numbers (decimal text) → versions (`versionnumbers`):
        what a Triton tool naming a version by its number means."""
        return {
            str(dv.number): v for (m, v), dv in self.versions.items() if m == model and dv.number
        }

    def resolve(self, model: str, version: str = "") -> DeployedVersion | None:
        """`deployed`, or None where it raises NotFound."""
        try:
            return self.deployed(model, version)
        except NotFound:
            return None

    def ready_workers(self, model: str, version: str) -> list[WorkerStatus]:
        """Live workers that report (`model`, `version`) ready."""
        key = f"{model}/{version}"
        return [
            w
            for w in self.workers.values()
            if w.models.get(key) == "ready" and w.is_fresh(self._max_age)
        ]

    def version_stats(self, model: str, version: str) -> list[ModelStats]:
        """The statistics live workers report for (`model`, `version`), one per worker."""
        key = f"{model}/{version}"
        return [
            w.stats[key]
            for w in self.workers.values()
            if key in w.stats and w.is_fresh(self._max_age)
        ]

    def version_state(self, model: str, version: str) -> str:
        """``ready`` if a live worker serves it, else the most telling worker state."""
        key = f"{model}/{version}"
        states = [
            w.models[key]
            for w in self.workers.values()
            if key in w.models and w.is_fresh(self._max_age)
        ]
        return summarize_states(states)

    def is_ready(self, model: str, version: str) -> bool:
        """Whether a live worker reports (`model`, `version`) ready (stops at the first)."""
        key = f"{model}/{version}"
        return any(
            w.models.get(key) == READY and w.is_fresh(self._max_age) for w in self.workers.values()
        )
