"""The tensor worker: serves the ONNX / TensorRT versions placed on its pool.

A `VersionHost` (catalog following, loading, heartbeat, make-before-break
unloading) whose versions are each served by a `ModelRunner` pulling
micro-batches, or, for a stateful (``sequence_batching``) version, by a
`SequenceRunner` taking its sequences' requests on this worker's own
subject. Lazy versions load on a gateway's load hint. See
docs/architecture.md ("The request path", "Load policy", "Sequences").
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from inferbus_common.bus import ensure_batch_stream
from inferbus_common.catalog import DeployedVersion
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.modelstats import ModelStats
from inferbus_worker import metrics
from inferbus_worker.engines import Engine, build_engine, warmup_batch_sizes
from inferbus_worker.heartbeat import VersionKey
from inferbus_worker.processing import build_processing
from inferbus_worker.runner import ModelRunner
from inferbus_worker.scriptpool import ScriptProcessing, start_script
from inferbus_worker.sequences import SequenceRunner
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.versionhost import VersionHost

log = logging.getLogger(__name__)


def _load_engine(engine: Engine, config: ModelConfig) -> None:
    """Load and warm up (blocking: run in a thread)."""
    engine.load()
    engine.warmup(warmup_batch_sizes(config))


Runner = ModelRunner | SequenceRunner
"""What serves one loaded version."""


class Worker(VersionHost[Runner]):
    """One worker process's serving machinery (see module docstring).

    Args:
        settings: the worker's settings, built once in `main`.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(
            settings,
            name="worker",
            rejected=metrics.ARTIFACTS_REJECTED,
            cache_max_bytes=settings.cache_max_bytes,
        )
        self.settings: WorkerSettings = settings
        self._trt_cache_dir: Path = settings.trt_cache_dir or self.cache.root / "tensorrt"
        self._lazy_requested: set[VersionKey] = set()
        """Lazy versions a load hint asked for (see `_on_load_hint`)."""

    def version_stats(self) -> dict[str, ModelStats]:
        """Each served version's cumulative statistics, for the heartbeat."""
        return {f"{m}/{v}": r.stats.snapshot() for (m, v), r in self.loaded.items()}

    @property
    def runners(self) -> dict[VersionKey, Runner]:
        """The runner of each loaded version."""
        return self.loaded

    def serves(self, dv: DeployedVersion) -> bool:
        """Tensor versions only: generative ones are the LLM worker's (`inferbus_worker.llm`)."""
        return not dv.config.generative

    async def _prepare(self, js: JetStreamContext) -> None:
        await ensure_batch_stream(js, self.subjects)

    async def _started(self, nc: Client) -> None:
        # Lazy versions load when a gateway publishes a hint for them (every
        # worker sees every hint; those whose pool serves the version load it).
        await nc.subscribe(self.subjects.load_hint_all, cb=self._on_load_hint)

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz; not ready while starting up with nothing loaded."""
        ready, reason = super().readiness()
        states = self.states.values()
        if ready and "loading" in states and "ready" not in states:
            # Starting up: nothing it could pull yet. Rollouts wait for this before
            # taking down the worker it replaces.
            return False, reason
        return ready, reason

    def _defer(self, key: VersionKey, dv: DeployedVersion) -> bool:
        """Lazy versions wait for a load hint; a promotion target never waits."""
        assert self._catalog is not None
        route = self._catalog.routes.get(key[0])
        pending = route is not None and route.stable_pending == key[1]
        if dv.config.load_policy != "lazy" or pending or key in self._lazy_requested:
            return False
        if self.states.get(key) != "lazy":
            self._set_state(key, "lazy")  # routed, waits for its first request
        return True

    async def _reconcile(self) -> None:
        self._lazy_requested &= set(self.desired())  # an unrouted lazy version starts lazy again
        await super()._reconcile()

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

    async def _open(self, key: VersionKey, dv: DeployedVersion, directory: Path) -> Runner:
        assert self._nc is not None
        engine: Engine | None = None
        runner: Runner | None = None
        script: ScriptProcessing | None = None
        try:
            # In a thread: placing a GPU engine asks NVML or nvidia-smi for free memory.
            engine = await asyncio.to_thread(
                build_engine,
                dv.config,
                directory,
                trt_cache_dir=self._trt_cache_dir,
                label=f"{dv.model} version {dv.version}",
            )
            await asyncio.to_thread(_load_engine, engine, dv.config)
            if dv.config.sequence_batching is not None:
                # A stateful model: requests come straight from the gateway on this
                # worker's own subject (inferbus_worker.sequences), not the work queue.
                runner = SequenceRunner(self._nc, self.subjects, self.instance_id, dv, engine)
            else:
                processing = await asyncio.to_thread(build_processing, dv.config, directory)
                # preprocessor.py (issue 27): its sandboxed processes, started before serving.
                limits = self.settings.script_limits(dv.config.instance_count)
                name = f"{dv.model}/{dv.version}"
                script = await start_script(dv.config, directory, name, limits)
                runner = ModelRunner(
                    self._nc,
                    self._nc.jetstream(),
                    self.subjects,
                    self.settings,
                    dv,
                    engine,
                    processing=processing,
                    script=script,
                )
            await runner.start()
        except BaseException:
            if runner is not None:
                await runner.stop()
            else:
                if script is not None:
                    await script.close()
                if engine is not None:
                    await asyncio.to_thread(engine.close)
            raise
        log.info("engine: %s", engine.description, extra={"model": dv.model, "version": dv.version})
        return runner

    async def _close(self, key: VersionKey, served: Runner, timeout_s: float) -> None:
        await served.stop()

    def _loaded_changed(self) -> None:
        metrics.MODELS_LOADED.set(len(self.loaded))

    def _on_loaded(self, key: VersionKey, seconds: float) -> None:
        metrics.LOAD_SECONDS.observe(seconds)
        super()._on_loaded(key, seconds)
