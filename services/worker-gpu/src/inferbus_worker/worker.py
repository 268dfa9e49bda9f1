"""The worker process: follows the catalog, loads versions, serves them, reports status.

`Worker` is an async context manager. Entering it serves /metrics /healthz
/readyz, connects to NATS, makes sure the micro-batch stream exists, opens the
`Catalog` and starts two owned tasks:

* the reconciler: the versions to serve are those a model's `Route` points
  at (``stable`` or any alias) whose ``config.pool`` is this worker's pool;
  each new one is fetched, loaded, warmed up and handed to a `ModelRunner`;
  versions no longer pointed at are drained and unloaded; failed loads are
  retried after ``load_retry_s``;
* the heartbeat: a `WorkerStatus` in the workers bucket every ``heartbeat_s``
  and at once whenever a version's state changes.

Leaving it drains: stop pulling, finish and ack in-flight batches, delete the
heartbeat, drain the NATS connection, stop the HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from types import TracebackType

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from inferbus_common import ops
from inferbus_common.bus import connect, ensure_batch_stream, shutdown
from inferbus_common.catalog import Catalog, DeployedVersion, WorkerStatus, ensure_kv
from inferbus_common.errors import FailedPrecondition, InferbusError
from inferbus_common.grpcauth import read_secret
from inferbus_common.lifecycle import default_instance_id
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.signing import SignatureError, parse_trusted_keys, signed_payload, verify
from inferbus_common.subjects import Subjects
from inferbus_worker import metrics
from inferbus_worker.artifacts import ArtifactCache, DigestMismatch
from inferbus_worker.engines import Engine, build_engine, warmup_batch_sizes
from inferbus_worker.heartbeat import NATS_ERRORS, Heartbeat, VersionKey, wait_event
from inferbus_worker.hostspec import HostSpec
from inferbus_worker.processing import build_processing
from inferbus_worker.runner import ModelRunner
from inferbus_worker.sequences import SequenceRunner
from inferbus_worker.settings import WorkerSettings

log = logging.getLogger(__name__)

_NATS_ERRORS = NATS_ERRORS


def _load_engine(engine: Engine, config: ModelConfig) -> None:
    """Load and warm up (blocking: run in a thread)."""
    engine.load()
    engine.warmup(warmup_batch_sizes(config))


class Worker:
    """One worker process's serving machinery (see module docstring).

    Args:
        settings: the worker's settings, built once in `main`.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.instance_id = settings.instance_id or default_instance_id("worker")
        self.subjects = Subjects(settings.subject_prefix)
        self._trusted_keys = parse_trusted_keys(settings.trusted_keys)
        self.cache = ArtifactCache(
            settings.cache_dir,
            settings.registry_url,
            timeout_s=settings.registry_timeout_s,
            max_bytes=settings.cache_max_bytes,
            in_use=lambda: set(self.runners) | set(self._loads),
            registry_token=read_secret(None, settings.registry_token_file),
        )
        self._trt_cache_dir: Path = settings.trt_cache_dir or self.cache.root / "tensorrt"
        self.states: dict[VersionKey, str] = {}
        self.runners: dict[VersionKey, ModelRunner | SequenceRunner] = {}
        self._unwanted_since: dict[VersionKey, float] = {}
        self.metrics_port = 0
        self._loads: dict[VersionKey, asyncio.Task[None]] = {}
        self._retry_at: dict[VersionKey, float] = {}
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
            stats=lambda: {f"{m}/{v}": r.stats.snapshot() for (m, v), r in self.runners.items()},
        )
        """Status record, host spec and pool admission (shared with the LLM worker)."""
        self._lazy_requested: set[VersionKey] = set()
        """Lazy versions a load hint asked for (see `_on_load_hint`)."""

    # --- lifecycle -----------------------------------------------------------
    async def __aenter__(self) -> Worker:
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
        ops.write_ports_file(self.settings.ports_file, {"metrics": self.metrics_port})
        self._nc = await connect(
            self.settings.nats_url, self.instance_id, **self.settings.nats_auth()
        )
        js = self._nc.jetstream()
        await ensure_batch_stream(js, self.subjects)
        self._workers_kv = await ensure_kv(js, self.subjects.workers_bucket)
        self._catalog = Catalog(js, self.subjects, on_change=self._changed.set)
        await self._catalog.__aenter__()
        await self._catalog.wait_loaded()
        self._catalog_loaded = True
        await self.heartbeat.detect()
        # Lazy versions load when a gateway publishes a hint for them (every
        # worker sees every hint; those whose pool serves the version load it).
        await self._nc.subscribe(self.subjects.load_hint_all, cb=self._on_load_hint)
        log.info(
            "worker started",
            extra={
                "worker_id": self.instance_id,
                "pool": self.settings.pool,
                "port": self.metrics_port,
            },
        )
        self._tasks.append(
            asyncio.create_task(
                self.heartbeat.run(self._workers_kv, lambda: self._closed), name="heartbeat"
            )
        )
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="reconcile"))

    async def drain(self) -> None:
        """Stop intake, finish in-flight batches, delete the heartbeat, close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # The loops also check `_closed`: nats-py requests use asyncio.wait_for,
        # which on Python 3.11 can swallow a cancellation that meets a reply.
        for task in self._tasks:
            task.cancel()
        for task in list(self._loads.values()):
            task.cancel()
        # gather (not suppress(CancelledError)) so a cancellation of drain itself is not lost.
        await asyncio.gather(*self._tasks, *self._loads.values(), return_exceptions=True)
        self._tasks.clear()
        runners = list(self.runners.values())
        self.runners.clear()
        if runners:
            try:
                async with asyncio.timeout(self.settings.drain_timeout_s):
                    await asyncio.gather(*(r.stop() for r in runners))
            except TimeoutError:
                log.warning("drain timed out; unacked batches will be redelivered elsewhere")
        metrics.MODELS_LOADED.set(0)
        if self._workers_kv is not None:
            await self.heartbeat.remove(self._workers_kv)
        if self._catalog is not None:
            await self._catalog.__aexit__(None, None, None)
        if self._nc is not None:
            await shutdown(self._nc, self.settings.drain_timeout_s)
        await self._stack.aclose()
        log.info("worker stopped", extra={"worker_id": self.instance_id})

    # --- readiness and status ----------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz: connected, catalog loaded; lists the versions."""
        if self._nc is None or not self._nc.is_connected:
            return False, "not connected to NATS"
        if not self._catalog_loaded:
            return False, "catalog not loaded"
        if self.admission:
            return False, self.admission
        if not self.states:
            return True, f"no version is placed on pool '{self.settings.pool}'"
        listing = "; ".join(f"{m}/{v}: {s}" for (m, v), s in sorted(self.states.items()))
        states = self.states.values()
        if "loading" in states and "ready" not in states:
            # Starting up: nothing it could pull yet. Rollouts wait for this before
            # taking down the worker it replaces.
            return False, listing
        return True, listing

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

    def _set_state(self, key: VersionKey, state: str | None) -> None:
        if state is None:
            self.states.pop(key, None)
        else:
            self.states[key] = state
        self.heartbeat.changed.set()

    def status(self) -> WorkerStatus:
        """This worker's heartbeat record, as of now."""
        return self.heartbeat.status()

    def _update_admission(self) -> None:
        """Recompute whether the pool's quota admits this worker (from live heartbeats)."""
        assert self._catalog is not None
        self.heartbeat.update_admission(self._catalog)

    # --- what to serve ---------------------------------------------------------
    def desired(self) -> dict[VersionKey, DeployedVersion]:
        """Versions this worker should serve, per the catalog."""
        assert self._catalog is not None
        out: dict[VersionKey, DeployedVersion] = {}
        if self.admission:
            return out  # over the pool's quota: serve nothing until admitted
        for (model, version), dv in self._catalog.versions.items():
            route = self._catalog.routes.get(model)
            if route is None or dv.config.pool != self.settings.pool:
                continue
            if dv.config.generative:
                continue  # served by the LLM worker (inferbus_worker.llm)
            # Canary and shadow versions get traffic from the router too.
            if (
                version in (route.stable, route.canary, route.shadow)
                or version in route.aliases.values()
            ):
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
        self._update_admission()
        want = self.desired()
        now = time.monotonic()
        self._lazy_requested &= set(want)  # an unrouted lazy version starts lazy again
        for key, dv in want.items():
            if key in self.runners or key in self._loads:
                continue
            if dv.config.load_policy == "lazy" and key not in self._lazy_requested:
                if self.states.get(key) != "lazy":
                    self._set_state(key, "lazy")  # routed, waits for its first request
                continue
            if self._retry_at.get(key, 0.0) > now:
                continue
            self._set_state(key, "loading")
            self._loads[key] = asyncio.create_task(self._load(key, dv), name=f"load-{key}")
        for key in [k for k in self._loads if k not in want]:
            self._loads[key].cancel()
        for key in list(self._unwanted_since):
            if key in want:
                del self._unwanted_since[key]
        for key in [k for k in self.runners if k not in want]:
            # Make-before-break: a version that lost its route keeps serving for a
            # grace period, so requests already routed (or queued) to it finish.
            since = self._unwanted_since.setdefault(key, now)
            if now - since < self.settings.unload_grace_s:
                continue
            del self._unwanted_since[key]
            runner = self.runners.pop(key)
            metrics.MODELS_LOADED.set(len(self.runners))
            log.info("unloading", extra={"model": key[0], "version": key[1]})
            await runner.stop()
            self.cache.mark_used(*key)  # used until now: evicted after older versions
            self._set_state(key, None)
        for key in [
            k
            for k in self.states
            if k not in want and k not in self._loads and k not in self.runners
        ]:
            self._retry_at.pop(key, None)
            self._set_state(key, None)

    async def _on_load_hint(self, msg: Msg) -> None:
        """A request wants a lazy version: load it if this worker's pool serves it."""
        try:
            doc = json.loads(msg.data)
            key = (str(doc["model"]), str(doc["version"]))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed load hint on %s", msg.subject)
            return
        if self._closed or key in self._lazy_requested or key not in self.desired():
            return
        log.info("load hint: loading lazy version", extra={"model": key[0], "version": key[1]})
        self._lazy_requested.add(key)
        self._changed.set()

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
            metrics.ARTIFACTS_REJECTED.labels(reason="signature").inc()
            raise FailedPrecondition(f"refusing to load: {exc}") from None

    async def _load(self, key: VersionKey, dv: DeployedVersion) -> None:
        assert self._nc is not None
        extra = {"model": dv.model, "version": dv.version}
        t0 = time.monotonic()
        engine: Engine | None = None
        runner: ModelRunner | SequenceRunner | None = None
        try:
            self._check_signature(dv)
            directory = await self.cache.fetch(dv)
            engine = build_engine(dv.config, directory, trt_cache_dir=self._trt_cache_dir)
            await asyncio.to_thread(_load_engine, engine, dv.config)
            if dv.config.sequence_batching is not None:
                # A stateful model: requests come straight from the gateway on this
                # worker's own subject (inferbus_worker.sequences), not the work queue.
                runner = SequenceRunner(self._nc, self.subjects, self.instance_id, dv, engine)
            else:
                processing = await asyncio.to_thread(build_processing, dv.config, directory)
                runner = ModelRunner(
                    self._nc,
                    self._nc.jetstream(),
                    self.subjects,
                    self.settings,
                    dv,
                    engine,
                    processing=processing,
                )
            await runner.start()
        except BaseException as exc:
            if runner is not None:
                await runner.stop()
            elif engine is not None:
                await asyncio.to_thread(engine.close)
            if isinstance(exc, asyncio.CancelledError):
                self._set_state(key, None)
                raise
            if isinstance(exc, DigestMismatch):
                metrics.ARTIFACTS_REJECTED.labels(reason="digest").inc()
            if isinstance(exc, InferbusError):
                reason = exc.message
            elif isinstance(exc, Exception):
                log.exception("loading failed", extra=extra)
                reason = f"{type(exc).__name__}: {exc}"
            else:
                raise
            log.error("loading failed: %s", reason, extra=extra)
            self._retry_at[key] = time.monotonic() + self.settings.load_retry_s
            self._set_state(key, f"failed: {reason}")
        else:
            if self._closed:
                # Drain began while loading and its cancellation was lost (see drain).
                await runner.stop()
                self._set_state(key, None)
                return
            self.runners[key] = runner
            self._retry_at.pop(key, None)
            self._set_state(key, "ready")
            metrics.MODELS_LOADED.set(len(self.runners))
            metrics.LOAD_SECONDS.observe(time.monotonic() - t0)
            log.info(
                "serving with %s",
                engine.description if engine else "?",
                extra={**extra, "latency_ms": round((time.monotonic() - t0) * 1000, 1)},
            )
        finally:
            self._loads.pop(key, None)
            self._changed.set()
