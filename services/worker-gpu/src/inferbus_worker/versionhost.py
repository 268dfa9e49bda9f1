"""`VersionHost`: what the tensor `Worker` and the `LlmWorker` share.

Follow the catalog, load the versions a route names on this pool, verify
their artifacts, heartbeat their states, unload a version that lost its route
after a grace period (make-before-break), drain on exit. Subclasses say which
versions they serve and how one is opened and closed. See
docs/architecture.md ("Version lifecycle", "Worker artifact cache bound").
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from prometheus_client import Counter

from inferbus_common import ops
from inferbus_common.bus import connect, shutdown
from inferbus_common.catalog import Catalog, DeployedVersion, WorkerStatus, ensure_kv
from inferbus_common.catalogrecords import FAILED, READY, REJECTED
from inferbus_common.errors import FailedPrecondition, InferbusError, StatusCode
from inferbus_common.grpcauth import read_secret
from inferbus_common.lifecycle import default_instance_id
from inferbus_common.modelstats import ModelStats
from inferbus_common.settings import NatsAuth
from inferbus_common.signing import SignatureError, parse_trusted_keys, signed_payload, verify
from inferbus_common.subjects import Subjects
from inferbus_worker.artifacts import ArtifactCache, DigestMismatch
from inferbus_worker.heartbeat import NATS_ERRORS, Heartbeat, VersionKey, wait_event
from inferbus_worker.hostspec import HostSpec

log = logging.getLogger(__name__)

#: Load failures that retrying cannot fix: the artifact failed its checks or the
#: config cannot be served. Reported as `catalogrecords.REJECTED` (FAILED_PRECONDITION).
PERMANENT_CODES = frozenset({StatusCode.FAILED_PRECONDITION, StatusCode.INVALID_ARGUMENT})


class HostSettings(Protocol):
    """The settings a version host reads (both workers' settings classes have them)."""

    instance_id: str
    subject_prefix: str
    nats_url: str
    host: str
    metrics_port: int
    ports_file: Path | None
    drain_timeout_s: float
    pool: str
    registry_url: str
    registry_token_file: Path | None
    registry_timeout_s: float
    cache_dir: Path
    trusted_keys: list[str]
    heartbeat_s: float
    load_retry_s: float
    unload_grace_s: float

    def nats_auth(self) -> NatsAuth:
        """NATS credentials."""
        ...


S = TypeVar("S")
"""What serves one loaded version (a `ModelRunner`, a `VersionServer`)."""


def describe_failure(exc: BaseException) -> str:
    """An exception as a version state's reason."""
    return exc.message if isinstance(exc, InferbusError) else f"{type(exc).__name__}: {exc}"


def failure_state(exc: BaseException) -> str:
    """The version state a load failure leaves: `REJECTED` for good, else `FAILED`."""
    permanent = isinstance(exc, InferbusError) and exc.code in PERMANENT_CODES
    return f"{REJECTED if permanent else FAILED}{describe_failure(exc)}"


async def _answer_alive(msg: Msg) -> None:
    """Answer a gateway's liveness probe (`Subjects.alive`)."""
    if msg.reply:
        with contextlib.suppress(*NATS_ERRORS):
            await msg.respond(b"")


class VersionHost(abc.ABC, Generic[S]):
    """A worker process's catalog-following version lifecycle (see module docstring).

    Args:
        settings: the process's settings, built once in `main`.
        name: what the process is, for its default instance id and logs.
        rejected: counter of refused artifacts, by reason (``signature``, ``digest``).
        cache_max_bytes: bound of the artifact cache (0 = unbounded).
    """

    def __init__(
        self, settings: HostSettings, *, name: str, rejected: Counter, cache_max_bytes: int = 0
    ) -> None:
        self.settings = settings
        self.name = name
        self.instance_id = settings.instance_id or default_instance_id(name)
        self.subjects = Subjects(settings.subject_prefix)
        self._trusted_keys = parse_trusted_keys(settings.trusted_keys)
        self._rejected = rejected
        self.cache = ArtifactCache(
            settings.cache_dir,
            settings.registry_url,
            timeout_s=settings.registry_timeout_s,
            max_bytes=cache_max_bytes,
            in_use=lambda: set(self.loaded) | set(self._loads),
            registry_token=read_secret(None, settings.registry_token_file),
        )
        self.states: dict[VersionKey, str] = {}
        """Each version's state as the heartbeat reports it."""
        self.loaded: dict[VersionKey, S] = {}
        """What serves each loaded version."""
        self.metrics_port = 0
        self._loads: dict[VersionKey, asyncio.Task[None]] = {}
        self._retry_at: dict[VersionKey, float] = {}
        self._unwanted_since: dict[VersionKey, float] = {}
        self._nc: Client | None = None
        self._catalog: Catalog | None = None
        self._workers_kv: KeyValue | None = None
        self._catalog_loaded = False
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stack = contextlib.AsyncExitStack()
        self._closed = False
        self.heartbeat = Heartbeat(
            self.instance_id,
            settings.pool,
            lambda: self.states,
            interval_s=settings.heartbeat_s,
            stats=self.version_stats,
        )
        """Status record, host spec, pool admission and statistics."""

    def version_stats(self) -> dict[str, ModelStats]:
        """Each served version's cumulative statistics for the heartbeat (none by default)."""
        return {}

    # --- what subclasses provide ------------------------------------------------------
    @abc.abstractmethod
    def serves(self, dv: DeployedVersion) -> bool:
        """Whether this kind of worker serves `dv` at all (tensor or generative)."""

    @abc.abstractmethod
    async def _open(self, key: VersionKey, dv: DeployedVersion, directory: Path) -> S:
        """Load a verified version from `directory` and start serving it."""

    @abc.abstractmethod
    async def _close(self, key: VersionKey, served: S, timeout_s: float) -> None:
        """Stop serving a version (in-flight work gets `timeout_s`)."""

    async def _prepare(self, js: JetStreamContext) -> None:
        """Before the catalog opens (e.g. make sure a stream exists)."""

    async def _started(self, nc: Client) -> None:
        """After the catalog is loaded: extra subscriptions and owned tasks."""

    def _defer(self, key: VersionKey, dv: DeployedVersion) -> bool:
        """True to leave a wanted version unloaded for now (e.g. a lazy one)."""
        return False

    # --- lifecycle --------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self.drain()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.drain()

    async def _start(self) -> None:
        sock = ops.bind_socket(self.settings.host, self.settings.metrics_port)
        self.metrics_port = sock.getsockname()[1]
        await self._stack.enter_async_context(ops.serve_http(ops.ops_app(self.readiness), sock))
        self._nc = await connect(
            self.settings.nats_url, self.instance_id, **self.settings.nats_auth()
        )
        js = self._nc.jetstream()
        await self._prepare(js)
        self._workers_kv = await ensure_kv(js, self.subjects.workers_bucket)
        self._catalog = Catalog(js, self.subjects, on_change=self._changed.set)
        await self._catalog.__aenter__()
        await self._catalog.wait_loaded()
        self._catalog_loaded = True
        await self.heartbeat.detect()
        # Liveness probes (gateways): answered with nothing. When this process
        # dies its connection closes and nats-server answers the next probe "no
        # responders", so gateways learn of a crash in a fraction of a second
        # instead of waiting for the heartbeat to go stale.
        alive = self.subjects.alive(self.instance_id)
        await self._nc.subscribe(alive, cb=_answer_alive)
        try:
            # Advertised only once a probe reaches it: were the subscription
            # refused (NATS permissions from an older release), every probe would
            # get "no responders" and gateways would take this live worker for dead.
            await self._nc.request(alive, b"", timeout=2.0)
            self.heartbeat.alive_subject = alive
        except NATS_ERRORS as exc:  # nats-py: its TimeoutError, NoRespondersError
            log.warning(
                "liveness probes do not reach this worker on %s (%r); gateways will learn "
                "of its crash from its heartbeat only",
                alive,
                exc,
            )
        await self._started(self._nc)
        self._own(self.heartbeat.run(self._workers_kv, lambda: self._closed), "heartbeat")
        self._own(self._reconcile_loop(), "reconcile")
        ops.write_ports_file(self.settings.ports_file, {"metrics": self.metrics_port})
        log.info(
            "%s started",
            self.name,
            extra={"worker_id": self.instance_id, "pool": self.settings.pool},
        )

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run `coro` as a task this host owns (cancelled and awaited by `drain`)."""
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def drain(self) -> None:
        """Stop intake, finish in-flight work, delete the heartbeat, close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # The loops also check `_closed`: nats-py requests use asyncio.wait_for,
        # which on Python 3.11 can swallow a cancellation that meets a reply.
        for task in [*self._tasks, *self._loads.values()]:
            task.cancel()
        # gather (not suppress(CancelledError)) so a cancellation of drain itself is not lost.
        await asyncio.gather(*self._tasks, *self._loads.values(), return_exceptions=True)
        self._tasks.clear()
        loaded = list(self.loaded.items())
        self.loaded.clear()
        if loaded:
            timeout = self.settings.drain_timeout_s
            try:
                async with asyncio.timeout(timeout + 5.0):
                    await asyncio.gather(*(self._close(k, s, timeout) for k, s in loaded))
            except TimeoutError:
                log.warning("drain timed out; unfinished work is redelivered or retried")
        self._loaded_changed()
        if self._workers_kv is not None:
            await self.heartbeat.remove(self._workers_kv)
        if self._catalog is not None:
            await self._catalog.__aexit__(None, None, None)
        if self._nc is not None:
            await shutdown(self._nc, self.settings.drain_timeout_s)
        await self._stack.aclose()
        log.info("%s stopped", self.name, extra={"worker_id": self.instance_id})

    def _loaded_changed(self) -> None:
        """`loaded` changed (gauges)."""

    # --- readiness and status ---------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz: connected, catalog loaded, admitted; lists versions."""
        if self._nc is None or not self._nc.is_connected:
            return False, "not connected to NATS"
        if not self._catalog_loaded:
            return False, "catalog not loaded"
        if self.admission:
            return False, self.admission
        if not self.states:
            return True, f"no version is placed on pool '{self.settings.pool}'"
        return True, "; ".join(f"{m}/{v}: {s}" for (m, v), s in sorted(self.states.items()))

    @property
    def spec(self) -> HostSpec:
        """CPUs, memory and GPUs of this process (detected at start, in the heartbeat)."""
        return self.heartbeat.spec

    @property
    def joined_unix_ms(self) -> int:
        """Start time: pools admit workers oldest first."""
        return self.heartbeat.joined_unix_ms

    @property
    def admission(self) -> str:
        """Why the pool's quota keeps this worker out ('' = admitted)."""
        return self.heartbeat.admission

    def status(self) -> WorkerStatus:
        """This worker's heartbeat record, as of now."""
        return self.heartbeat.status()

    def _set_state(self, key: VersionKey, state: str | None) -> None:
        if state is None:
            self.states.pop(key, None)
        else:
            self.states[key] = state
        self.heartbeat.changed.set()

    # --- what to serve ----------------------------------------------------------------
    def desired(self) -> dict[VersionKey, DeployedVersion]:
        """Versions to serve: those this kind serves, placed on this pool, that a route
        names (stable, canary, shadow, an alias, or a pending promotion)."""
        assert self._catalog is not None
        out: dict[VersionKey, DeployedVersion] = {}
        if self.admission:
            return out  # over the pool's quota: serve nothing until admitted
        for (model, version), dv in self._catalog.versions.items():
            route = self._catalog.routes.get(model)
            if route is None or dv.config.pool != self.settings.pool or not self.serves(dv):
                continue
            if version in route.served_versions():
                out[(model, version)] = dv
        return out

    async def _reconcile_loop(self) -> None:
        while not self._closed:
            self._changed.clear()
            await self._reconcile()
            # Wake on catalog changes, and now and then to retry failed loads
            # (sooner while a retired version waits out its grace period).
            wait = self.settings.load_retry_s
            if self._unwanted_since:
                wait = min(wait, max(0.05, self.settings.unload_grace_s / 4))
            await wait_event(self._changed, wait)

    async def _reconcile(self) -> None:
        assert self._catalog is not None
        self.heartbeat.update_admission(self._catalog)
        want = self.desired()
        now = time.monotonic()
        for key, dv in want.items():
            if key in self.loaded or key in self._loads or self._defer(key, dv):
                continue
            if self._retry_at.get(key, 0.0) > now:
                continue
            self._set_state(key, "loading")
            self._loads[key] = asyncio.create_task(self._load(key, dv), name=f"load-{key}")
        for key in [k for k in self._loads if k not in want]:
            self._loads[key].cancel()
        for key in [k for k in self._unwanted_since if k in want]:
            del self._unwanted_since[key]
        for key in [k for k in self.loaded if k not in want]:
            # Make-before-break: a version that lost its route keeps serving for a
            # grace period, so requests already routed (or queued) to it finish.
            since = self._unwanted_since.setdefault(key, now)
            if now - since < self.settings.unload_grace_s:
                continue
            del self._unwanted_since[key]
            served = self.loaded.pop(key)
            self._loaded_changed()
            log.info("unloading", extra={"model": key[0], "version": key[1]})
            await self._close(key, served, self.settings.drain_timeout_s)
            self.cache.mark_used(*key)  # used until now: evicted after older versions
            self._set_state(key, None)
        for key in [
            k
            for k in self.states
            if k not in want and k not in self._loads and k not in self.loaded
        ]:
            self._retry_at.pop(key, None)
            self._set_state(key, None)

    # --- loading ----------------------------------------------------------------------
    def _check_signature(self, dv: DeployedVersion) -> None:
        """Refuse a version not signed by a trusted registry key (when keys are configured).

        Raises:
            FailedPrecondition: unsigned, unknown key, or digests that do not
                match the signature; counted in the rejected-artifacts metric.
        """
        if not self._trusted_keys:
            return
        payload = signed_payload(dv.model, dv.version, dv.files)
        try:
            verify(self._trusted_keys, dv.key_id, dv.signature, payload)
        except SignatureError as exc:
            self._rejected.labels(reason="signature").inc()
            raise FailedPrecondition(f"refusing to load: {exc}") from None

    async def _load(self, key: VersionKey, dv: DeployedVersion) -> None:
        extra = {"model": dv.model, "version": dv.version}
        t0 = time.monotonic()
        try:
            self._check_signature(dv)
            directory = await self.cache.fetch(dv)
            served = await self._open(key, dv, directory)
        except asyncio.CancelledError:
            self._set_state(key, None)
            raise
        except Exception as exc:
            if isinstance(exc, DigestMismatch):
                self._rejected.labels(reason="digest").inc()
            if not isinstance(exc, InferbusError):
                log.exception("loading failed", extra=extra)
            state = failure_state(exc)
            log.error("loading failed: %s", state, extra=extra)
            self._retry_at[key] = time.monotonic() + self.settings.load_retry_s
            self._set_state(key, state)
        else:
            if self._closed:
                # Drain began while loading and its cancellation was lost (see drain).
                await self._close(key, served, 0.0)
                self._set_state(key, None)
                return
            self.loaded[key] = served
            self._retry_at.pop(key, None)
            self._set_state(key, READY)
            self._loaded_changed()
            self._on_loaded(key, time.monotonic() - t0)
        finally:
            self._loads.pop(key, None)
            self._changed.set()

    def _on_loaded(self, key: VersionKey, seconds: float) -> None:
        """A version started serving after `seconds` (logs; subclasses add metrics)."""
        log.info(
            "serving",
            extra={"model": key[0], "version": key[1], "latency_ms": round(seconds * 1000, 1)},
        )
