"""`LlmWorker`: serves the generative (vLLM) versions placed on its pool.

A `VersionHost` (catalog following, artifact checks, heartbeat, unload grace)
whose versions are each served by a `VersionServer`; it also owns the
cancel subscription, the engine health poll and the fatal hook. See
docs/architecture.md ("The generative path").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from nats.aio.client import Client
from nats.aio.msg import Msg

from inferbus_common.catalog import DeployedVersion
from inferbus_common.subjects import name_from_token
from inferbus_worker.heartbeat import VersionKey
from inferbus_worker.llm import metrics
from inferbus_worker.llm.engine import EngineStats, LlmEngine, detect_device
from inferbus_worker.llm.loopwatch import watch_loop
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.versionserver import VersionServer
from inferbus_worker.versionhost import VersionHost

log = logging.getLogger(__name__)

_VERSION_GAUGES = (
    metrics.ENGINE_UNFINISHED,
    metrics.RUNNING_SEQS,
    metrics.WAITING_SEQS,
    metrics.KV_CACHE_USAGE,
    metrics.IN_FLIGHT,
    metrics.ESTIMATED_WAIT,
)


class LlmWorker(VersionHost[VersionServer]):
    """One LLM worker process (see module docstring).

    Args:
        settings: built once in `main`.
        on_fatal: called once with the reason when the worker cannot go on (a dead
            engine that could not be restarted); ``__main__`` then drains and exits 1.
    """

    def __init__(
        self, settings: LlmWorkerSettings, on_fatal: Callable[[str], None] | None = None
    ) -> None:
        super().__init__(settings, name="llm-worker", rejected=metrics.ARTIFACTS_REJECTED)
        self.settings: LlmWorkerSettings = settings
        self._on_fatal = on_fatal
        self.fatal = ""
        """Why the worker gave up ('' while it serves)."""
        self.device = detect_device(settings.device)

    @property
    def servers(self) -> dict[VersionKey, VersionServer]:
        """The server of each loaded version."""
        return self.loaded

    def serves(self, dv: DeployedVersion) -> bool:
        """Generative versions only."""
        return dv.config.generative

    async def _started(self, nc: Client) -> None:
        await nc.subscribe(self.subjects.gen_cancel_all, cb=self._on_cancel)
        self._own(self._gauge_loop(), "gauges")
        self._own(watch_loop(), "loop-lag")

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz: also not ready after giving up or with a dead engine."""
        ready, reason = super().readiness()
        if not ready:
            return ready, reason
        if self.fatal:
            return False, self.fatal
        down = [f"{m}/{v}: {s.down}" for (m, v), s in sorted(self.loaded.items()) if s.down]
        if down:
            return False, "; ".join(down)
        return ready, reason

    def _give_up(self, reason: str) -> None:
        if self.fatal:
            return
        self.fatal = reason
        if self._on_fatal is not None:
            self._on_fatal(reason)

    async def _gauge_loop(self) -> None:
        """Engine-side numbers that only exist by asking the engine; its health too."""
        while not self._closed:
            for (model, version), server in list(self.loaded.items()):
                server.check_engine()
                if server.down:
                    continue
                try:
                    unfinished = server.engine.unfinished()
                except Exception as exc:  # a gauge must not stop the loop
                    log.warning("reading the engine's unfinished requests failed: %r", exc)
                    continue
                metrics.ENGINE_UNFINISHED.labels(model, version).set(unfinished)
            await asyncio.sleep(0.25)

    async def _on_cancel(self, msg: Msg) -> None:
        rid = name_from_token(msg.subject.rsplit(".", 1)[-1])
        for server in list(self.loaded.values()):
            if server.cancel(rid, "cancelled"):
                log.info("generation cancelled", extra={"request_id": rid})

    @staticmethod
    def _model_dir(directory: Path, dv: DeployedVersion) -> Path:
        """The Hugging Face directory: the one holding ``config.file``."""
        parent = PurePosixPath(dv.config.file).parent
        return directory.joinpath(*parent.parts) if parent.parts else directory

    async def _open(self, key: VersionKey, dv: DeployedVersion, directory: Path) -> VersionServer:
        assert self._nc is not None
        labels = (dv.model, dv.version)

        def on_stats(stats: EngineStats) -> None:
            metrics.RUNNING_SEQS.labels(*labels).set(stats.running)
            metrics.WAITING_SEQS.labels(*labels).set(stats.waiting)
            metrics.KV_CACHE_USAGE.labels(*labels).set(stats.kv_cache_usage)
            if stats.prefix_queried_tokens:
                metrics.PREFIX_QUERIED.labels(*labels).inc(stats.prefix_queried_tokens)
                metrics.PREFIX_HITS.labels(*labels).inc(stats.prefix_hit_tokens)

        engine = LlmEngine(dv.config, self._model_dir(directory, dv), self.device, on_stats)
        try:
            await asyncio.to_thread(engine.start)
            await engine.warm_up()
            server = VersionServer(
                self._nc,
                self.subjects,
                dv,
                engine,
                self.settings,
                on_state=lambda state: self._set_state(key, state),
                on_fatal=self._give_up,
                worker_id=self.instance_id,
            )
            await server.start()
        except BaseException:
            await asyncio.to_thread(engine.shutdown)
            raise
        log.info("engine: %s", engine.description, extra={"model": dv.model, "version": dv.version})
        return server

    async def _close(self, key: VersionKey, served: VersionServer, timeout_s: float) -> None:
        await served.stop(timeout_s)
        for gauge in _VERSION_GAUGES:
            with contextlib.suppress(KeyError):
                gauge.remove(*key)
