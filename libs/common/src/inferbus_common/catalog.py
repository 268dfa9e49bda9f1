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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
    "LastWorker",
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


@dataclass(frozen=True, slots=True)
class LastWorker:
    """The last worker that served a version, and how it stopped serving it.

    What a "no worker" answer tells the operator (`Catalog.last_worker`).
    """

    worker_id: str
    host: str
    pid: int
    heartbeat_ms: int
    """Wall-clock time of its last heartbeat (ms)."""
    lost_ms: int
    """When it stopped counting as serving the version (ms): found gone, its
    record deleted, or its heartbeat older than the catalog's maximum age."""
    how: str
    """``gone`` (its NATS connection is gone: crashed or killed), ``stopped``
    (it deleted its record: a graceful stop), ``unloaded`` (it no longer reports
    the version ready) or ``stale`` (no heartbeat for the maximum age: hung,
    partitioned, or died unseen)."""


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
        self.gone: dict[str, int] = {}
        """Worker key → the heartbeat time (ms) of a worker found gone (`mark_gone`):
        not counted as serving anything until a newer heartbeat or `mark_alive`."""
        # "<model>/<version>" -> worker key -> heartbeat ts_ms, of the workers not
        # found gone that report it ready (fresh or not), and the newest of them:
        # `is_ready` is one dict lookup and a clock read on the request path.
        self._ready_by: dict[str, dict[str, int]] = {}
        self._serving: dict[str, tuple[int, str]] = {}
        # "<model>/<version>" -> the worker that served it last, once it stopped.
        self._last: dict[str, LastWorker] = {}
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
        old = self.workers.get(key)
        if value is None:
            self.workers.pop(key, None)
            self.gone.pop(key, None)
            self._index_worker(key, old, None, "stopped")
            return
        ws = WorkerStatus.model_validate_json(value)
        self.workers[key] = ws
        if key in self.gone and ws.ts_ms > self.gone[key]:
            del self.gone[key]  # heartbeats again: it reconnected, or a new life
        self._index_worker(key, old, None if key in self.gone else ws, "stopped")

    def mark_gone(self, key: str) -> bool:
        """The worker of `key` is gone (its connection closed: a liveness probe got
        "no responders"); it serves nothing until it heartbeats again.

        Returns:
            Whether this changed anything (it was not known gone already).
        """
        ws = self.workers.get(key)
        if ws is None or key in self.gone:
            return False
        self.gone[key] = ws.ts_ms
        self._index_worker(key, ws, None, "gone")
        return True

    def mark_alive(self, key: str) -> None:
        """A worker found gone answers again (it had lost NATS for a moment)."""
        if self.gone.pop(key, None) is not None:
            ws = self.workers.get(key)
            self._index_worker(key, None, ws, "stopped")

    def _index_worker(
        self, key: str, old: WorkerStatus | None, new: WorkerStatus | None, how: str
    ) -> None:
        """Keep `_serving` (the newest ready heartbeat per version) as the worker of
        `key` goes from `old` to `new` (None: not counted); a version it was the
        last to serve gets a `LastWorker` record saying `how` it went."""
        keys = set(old.models) if old is not None else set()
        if new is not None:
            keys.update(new.models)
        now_ms = int(time.time() * 1000)
        max_age_ms = int(self._max_age * 1000)
        for mv in keys:
            had = self._serving.get(mv)
            by = self._ready_by.get(mv)
            if new is not None and new.models.get(mv) == READY:
                if by is None:
                    by = self._ready_by[mv] = {}
                by[key] = new.ts_ms
            elif by is not None:
                by.pop(key, None)
            if by:
                best = max(by.items(), key=lambda kv: kv[1])
                self._serving[mv] = (best[1], best[0])
            else:
                self._ready_by.pop(mv, None)
                self._serving.pop(mv, None)
            now = self._serving.get(mv)
            if (
                had is None
                or had[1] != key
                or old is None
                or (now is not None and now[1] == key)
                or (now is not None and now_ms - now[0] <= max_age_ms)
            ):
                continue  # not the worker that served it last, or it is still served
            # The last live worker of `mv` stopped serving it (the others left
            # in the index, if any, are stale).
            fresh = now_ms - had[0] <= max_age_ms
            self._last[mv] = LastWorker(
                old.worker_id,
                old.host,
                old.pid,
                had[0],
                now_ms if fresh else had[0] + max_age_ms,
                ("unloaded" if new is not None else how) if fresh else "stale",
            )

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

    def live_workers(self) -> list[WorkerStatus]:
        """Workers with a fresh heartbeat that are not known gone (`mark_gone`)."""
        return [
            w for k, w in self.workers.items() if k not in self.gone and w.is_fresh(self._max_age)
        ]

    def ready_workers(self, model: str, version: str) -> list[WorkerStatus]:
        """Live workers that report (`model`, `version`) ready."""
        key = f"{model}/{version}"
        return [w for w in self.live_workers() if w.models.get(key) == READY]

    def version_stats(self, model: str, version: str) -> list[ModelStats]:
        """The statistics live workers report for (`model`, `version`), one per worker."""
        key = f"{model}/{version}"
        return [w.stats[key] for w in self.live_workers() if key in w.stats]

    def version_state(self, model: str, version: str) -> str:
        """``ready`` if a live worker serves it, else the most telling worker state
        (``no worker`` when no live worker reports it at all)."""
        key = f"{model}/{version}"
        if self._ready_now(key):
            return READY
        states = [w.models[key] for w in self.live_workers() if key in w.models]
        return summarize_states(states)

    def is_ready(self, model: str, version: str) -> bool:
        """Whether a live worker reports (`model`, `version`) ready: O(1), one dict
        lookup and a clock read (the index is kept as heartbeats arrive)."""
        return self._ready_now(f"{model}/{version}")

    def _ready_now(self, key: str) -> bool:
        serving = self._serving.get(key)
        return serving is not None and time.time() * 1000 - serving[0] <= self._max_age * 1000

    @property
    def heartbeat_max_age_s(self) -> float:
        """A worker whose heartbeat is older is not live."""
        return self._max_age

    def lost_since(self, since_ms: float) -> list[tuple[str, str, LastWorker]]:
        """(model, version, its last worker) of each version no live worker serves
        that lost its last one at or after `since_ms` (ms). O(versions)."""
        out: list[tuple[str, str, LastWorker]] = []
        for key in dict.fromkeys([*self._serving, *self._last]):
            model, _, version = key.rpartition("/")
            last = self.last_worker(model, version)
            if last is not None and last.lost_ms >= since_ms:
                out.append((model, version, last))
        return out

    def last_worker(self, model: str, version: str) -> LastWorker | None:
        """The last worker that served (`model`, `version`) when none serves it now
        (None: one serves it, or none did since this catalog started). O(1)."""
        key = f"{model}/{version}"
        serving = self._serving.get(key)
        last = self._last.get(key)
        if serving is not None:
            if self._ready_now(key):
                return None
            # Its newest ready heartbeat is too old: stale since heartbeat + max age.
            lost_ms = serving[0] + int(self._max_age * 1000)
            if last is None or last.lost_ms < lost_ms:
                ws = self.workers.get(serving[1])
                return LastWorker(
                    ws.worker_id if ws is not None else serving[1],
                    ws.host if ws is not None else "",
                    ws.pid if ws is not None else 0,
                    serving[0],
                    lost_ms,
                    "stale",
                )
        return last
