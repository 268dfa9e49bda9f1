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
live; every service that needs to know what is deployed holds one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field, ValidationError

from inferbus_common.bus import replicas_of
from inferbus_common.errors import FailedPrecondition, InferbusError, NotFound, Unavailable
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.modelstats import ModelStats
from inferbus_common.resolver import pinned_version
from inferbus_common.subjects import Subjects
from inferbus_common.versionnumbers import integer_version

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
    number: int = 0
    """Triton-style integer number, unique within the model (`versionnumbers`;
    0: a record from before versions were numbered)."""

    @property
    def has_profile(self) -> bool:
        """The version carries a drift reference profile (``profile.json``, see `drift`)."""
        return "profile.json" in self.files


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
    stable_pending: str = ""
    """Version the ``stable`` alias was moved to while `stable` keeps serving until a
    worker reports it ready (make-before-break); '' when no promotion is pending.
    Workers load it like any routed version; nothing routes requests to it."""
    stable_pending_since_unix_ms: int = 0
    """When the pending promotion began (the registry abandons it after its timeout)."""

    def served_versions(self) -> set[str]:
        """Versions workers must load for this route: every version it names."""
        named = {self.stable, self.canary, self.shadow, self.stable_pending}
        named.update(self.aliases.values())
        named.discard("")
        return named


READY = "ready"
"""Version state: a worker serves it."""
FAILED = "failed: "
"""Prefix of the state of a version whose load failed and will be retried."""
REJECTED = "failed permanently: "
"""Prefix of the state of a version a worker refuses to load (its artifact failed its
digest or signature check, or its config cannot be served): retrying cannot help."""


def is_rejected(state: str) -> bool:
    """Whether a version state is a permanent load failure (see `REJECTED`)."""
    return state.startswith(REJECTED)


def not_ready_error(model: str, version: str, state: str) -> InferbusError:
    """The error a request for a version that is not ready gets.

    A version its workers refuse for good (`REJECTED`) is FAILED_PRECONDITION:
    retrying cannot help, the operator must fix or move the alias. Anything
    else (loading, a failure that is retried, no worker yet) is UNAVAILABLE.
    """
    where = f"model '{model}' version '{version}'"
    if is_rejected(state):
        return FailedPrecondition(
            f"{where} cannot be served: {state}; point the alias or route at another "
            "version (`inferbus models alias`, `inferbus route set`)"
        )
    return Unavailable(
        f"{where} is not ready ({state}); check `inferbus status` and the worker logs"
    )


class WorkerStatus(BaseModel):
    """A worker's heartbeat."""

    worker_id: str
    pool: str
    models: dict[str, str] = Field(default_factory=dict)
    """``"<model>/<version>"`` → ``ready`` | ``loading`` | ``lazy`` | ``failed: <reason>``
    | ``failed permanently: <reason>``."""
    ts_ms: int = 0
    """Wall-clock time of the heartbeat."""
    host: str = ""
    pid: int = 0
    cpus: int = 0
    """CPUs this worker may use (its affinity mask); 0 = unknown."""
    memory_bytes: int = 0
    """Memory available to it (cgroup limit, else the host's); 0 = unknown."""
    gpu_type: str = ""
    """GPU model name from NVML / nvidia-smi ('' = none)."""
    gpu_count: int = 0
    """GPUs visible to it (0 = none or unknown)."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """UUIDs of those GPUs (empty: unknown): pools count a GPU that several workers
    share once (`count_gpus`)."""
    joined_unix_ms: int = 0
    """When the worker started: pools admit workers in join order (oldest first)."""
    admitted: bool = True
    """False while its pool's quota keeps it out (it then serves nothing)."""
    reason: str = ""
    """Why it is not admitted ('' when admitted)."""
    stats: dict[str, ModelStats] = Field(default_factory=dict)
    """``"<model>/<version>"`` → cumulative inference statistics of the versions it
    serves (Triton's statistics extension sums them over live workers)."""

    def is_fresh(self, max_age_s: float) -> bool:
        """Whether the heartbeat is recent enough to trust."""
        return (time.time() * 1000 - self.ts_ms) <= max_age_s * 1000


class PoolSpec(BaseModel):
    """A worker pool's quota and release state (the pools bucket, key = pool token)."""

    name: str
    max_workers: int = Field(default=0, ge=0)
    """Workers admitted at most (0 = unlimited); later joiners stay not-ready."""
    max_gpus: int = Field(default=0, ge=0)
    """Sum of admitted workers' GPUs at most (0 = unlimited)."""
    state: str = "open"
    """Release state: ``open`` or ``frozen`` (traffic changes and rollouts onto it refused)."""
    updated_by: str = ""
    updated_unix_ms: int = 0


POOL_STATES = ("open", "frozen")
"""Release states a pool can be in."""


def new_gpus(worker: WorkerStatus, seen: set[str]) -> int:
    """GPUs `worker` adds to those whose UUIDs are in `seen` (and adds its UUIDs to `seen`).

    A worker that reports no UUIDs (an older worker, or nvidia-smi without
    them) counts all its GPUs.
    """
    if not worker.gpu_uuids:
        return worker.gpu_count
    fresh = set(worker.gpu_uuids) - seen
    seen.update(fresh)
    return len(fresh)


def count_gpus(workers: list[WorkerStatus]) -> int:
    """Physical GPUs of `workers`: each UUID once, however many workers share it."""
    seen: set[str] = set()
    return sum(new_gpus(w, seen) for w in workers)


def pool_admission(pool: str, workers: list[WorkerStatus], spec: PoolSpec | None) -> dict[str, str]:
    """Which live workers of `pool` its quota admits: worker id → '' or the reason it is out.

    Workers are admitted oldest first (`joined_unix_ms`, then id), so every
    worker computes the same answer from the same heartbeats without talking
    to the others; a worker that leaves lets the next one in.
    """
    members = sorted(
        (w for w in workers if w.pool == pool), key=lambda w: (w.joined_unix_ms, w.worker_id)
    )
    out: dict[str, str] = {}
    count = gpus = 0
    seen: set[str] = set()
    for w in members:
        reason = ""
        # Only GPUs no admitted worker brought yet count (two workers on one GPU: one).
        adds = new_gpus(w, set(seen))
        if spec is not None and spec.max_workers and count + 1 > spec.max_workers:
            reason = (
                f"pool '{pool}' is full: max_workers {spec.max_workers} already admitted; "
                f"raise it with `inferbus pools set {pool} --max-workers N` or stop a worker"
            )
        elif spec is not None and spec.max_gpus and gpus + adds > spec.max_gpus:
            reason = (
                f"pool '{pool}' GPU quota exceeded: {gpus} of max_gpus {spec.max_gpus} in use, "
                f"this worker has {adds} more; raise it with `inferbus pools set {pool} "
                "--max-gpus N`"
            )
        if not reason:
            count += 1
            gpus += new_gpus(w, seen)
        out[w.worker_id] = reason
    return out


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


class InitialValues:
    """Tells when a KV watcher has delivered every value its bucket held when it started.

    Not nats-py's ``None`` marker alone: the watcher sends it when a consumer-info
    reply says nothing is pending and nothing was received yet, and that reply
    can overtake the entries the server already sent. A worker that trusted it
    saw an empty pool, admitted itself over the quota and started loading.
    Here the initial values are in once the entry at the bucket's last revision
    before the watch (or a later one) has arrived, or the consumer has nothing
    pending; for an empty bucket the marker is enough.

    Use `watch` to open the watcher, then feed every item it yields to `see`.
    """

    __slots__ = ("done", "upto")

    def __init__(self, upto: int) -> None:
        self.upto = upto
        """The bucket's last revision (stream sequence) just before the watch."""
        self.done = False

    @classmethod
    async def watch(cls, kv: KeyValue) -> tuple[KeyValue.KeyWatcher, InitialValues]:
        """Watch every key of `kv` (deletes included) and track its initial values."""
        upto = (await kv.status()).stream_info.state.last_seq
        return await kv.watchall(), cls(upto)

    def see(self, entry: KeyValue.Entry | None) -> bool:
        """Account for one item from the watcher; True once the initial values are in."""
        if not self.done:
            if entry is None:
                self.done = self.upto == 0
            else:
                self.done = (entry.revision or 0) >= self.upto or entry.delta == 0
        return self.done


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


def summarize_states(states: list[str]) -> str:
    """One version's state across workers: ``ready`` if any serves it, else a permanent
    failure, else a retried failure, else the first state; ``no worker`` without any."""
    if READY in states:
        return READY
    for prefix in (REJECTED, FAILED):
        found = [s for s in states if s.startswith(prefix)]
        if found:
            return found[0]
    return states[0] if states else "no worker"
