"""Supervision of one version's vLLM engine: notice it died, fail what it held with
UNAVAILABLE, restart it in place (a bounded number of times in a row), else
give up so the process is restarted. See docs/architecture.md ("The
generative path", "A dead engine is restarted in the process").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from inferbus_common.catalog import DeployedVersion
from inferbus_worker.llm import metrics
from inferbus_worker.llm.engine import ENGINE_DIED, LlmEngine
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.versionhost import describe_failure

log = logging.getLogger(__name__)

RESTARTING = "restarting: the vLLM engine died"
"""Version state (heartbeat, /readyz) while its engine is being restarted."""
DEAD_GRACE_S = 2.0
"""How long in-flight requests of a dead engine get to end by themselves (vLLM
fails them at once) before they are cancelled with an UNAVAILABLE chunk."""


class EngineSupervision:
    """Restarts a dead engine in place (a mixin of `VersionServer`, which sets the
    attributes below)."""

    dv: DeployedVersion
    engine: LlmEngine
    down: str
    _settings: LlmWorkerSettings
    _labels: tuple[str, str]
    _stopping: bool
    _recovery: asyncio.Task[None] | None
    _tasks: dict[str, asyncio.Task[None]]
    _on_state: Callable[[str], None]
    _on_fatal: Callable[[str], None]

    @property
    def in_flight(self) -> int:
        """Requests held (running + waiting in the engine)."""
        raise NotImplementedError

    def check_engine(self) -> None:
        """Start recovering if vLLM reports the engine errored (the health poll)."""
        if not self.down and self.engine.dead:
            self.engine_died("vLLM reports the engine errored")

    def engine_died(self, why: str) -> None:
        """Turn not ready and recover in the background (once; later calls are no-ops)."""
        if self.down or self._stopping:
            return
        self.down = f"{ENGINE_DIED} (the worker is restarting it)"
        self._on_state(RESTARTING)
        self._recovery = asyncio.create_task(
            self._recover(why), name=f"recover-{self.dv.model}/{self.dv.version}"
        )

    async def _recover(self, why: str) -> None:
        """`_restart`; an unexpected error in it is fatal (the process restarts)."""
        try:
            await self._restart(why)
        except Exception as exc:
            log.exception(
                "recovering the vLLM engine failed",
                extra={"model": self.dv.model, "version": self.dv.version},
            )
            self.down = f"recovering the dead vLLM engine failed ({describe_failure(exc)})"
            self._on_state(f"failed: {self.down}")
            self._on_fatal(self.down)

    async def _restart(self, why: str) -> None:
        """Fail in-flight requests, shut the dead engine down, start a new one."""
        extra = {"model": self.dv.model, "version": self.dv.version}
        attempts = self._settings.engine_restart_attempts
        log.error(
            "the vLLM engine died (%s): failing %d in-flight requests with UNAVAILABLE "
            "and restarting it",
            why,
            self.in_flight,
            extra=extra,
        )
        t0 = time.monotonic()
        await self._fail_in_flight()
        self._zero_gauges()
        await self._shutdown(self.engine)
        failures = 0
        while True:
            engine = self.engine.fresh()
            try:
                await asyncio.to_thread(engine.start)
            except Exception as exc:
                failures += 1
                metrics.ENGINE_RESTARTS.labels(*self._labels, "failed").inc()
                reason = describe_failure(exc)
                log.exception("restarting the vLLM engine failed", extra=extra)
                await self._shutdown(engine)
                if failures >= attempts:
                    self.down = (
                        f"the vLLM engine died and {failures} restarts in a row failed "
                        f"(last: {reason})"
                    )
                    log.critical(
                        "%s; giving up: the worker exits for its supervisor to restart it",
                        self.down,
                        extra=extra,
                    )
                    self._on_state(f"failed: {self.down}")
                    self._on_fatal(self.down)
                    return
                log.error(
                    "restart %d of %d of the vLLM engine failed (%s); next try in %.1f s",
                    failures,
                    attempts,
                    reason,
                    self._settings.load_retry_s,
                    extra=extra,
                )
                self._on_state(f"{RESTARTING}; restart {failures} of {attempts} failed: {reason}")
                await asyncio.sleep(self._settings.load_retry_s)
                continue
            break
        self.engine = engine
        self.down = ""
        self._recovery = None
        metrics.ENGINE_RESTARTS.labels(*self._labels, "ok").inc()
        self._on_state("ready")
        log.warning(
            "vLLM engine restarted (%d failed attempts before); serving again",
            failures,
            extra={**extra, "latency_ms": round((time.monotonic() - t0) * 1000, 1)},
        )

    async def _fail_in_flight(self) -> None:
        """Let requests end by themselves (vLLM fails them), then cancel the rest.

        Either way each one ends with exactly one final UNAVAILABLE chunk.
        """
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=DEAD_GRACE_S)
        for task in pending:
            metrics.ABORTED.labels(*self._labels, "engine-dead").inc()
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _shutdown(self, engine: LlmEngine) -> None:
        """Stop an engine within ``engine_shutdown_timeout_s`` (plus a margin for vLLM)."""
        limit = self._settings.engine_shutdown_timeout_s
        try:
            async with asyncio.timeout(limit + 5.0):
                await asyncio.to_thread(engine.shutdown, limit)
        except TimeoutError:
            log.error(
                "the vLLM engine did not shut down within %.0f s; going on without it",
                limit,
                extra={"model": self.dv.model, "version": self.dv.version},
            )
        except Exception:
            log.exception(
                "shutting the vLLM engine down failed",
                extra={"model": self.dv.model, "version": self.dv.version},
            )

    def _zero_gauges(self) -> None:
        """A stopped or dead engine holds nothing: its engine-side gauges read 0."""
        for gauge in (
            metrics.ENGINE_UNFINISHED,
            metrics.RUNNING_SEQS,
            metrics.WAITING_SEQS,
            metrics.KV_CACHE_USAGE,
        ):
            gauge.labels(*self._labels).set(0)
