"""``python -m inferbus_worker.llm``: run an LLM worker until SIGTERM, then drain.

Run it with the vLLM environment's interpreter (``.venvs/vllm/bin/python``).
The ``__main__`` guard matters: vLLM starts its engine in child processes, and
a spawned child re-imports the main module.

Exit status 0 after SIGTERM/SIGINT; 1 when the worker gave up (a dead vLLM
engine that could not be restarted), so its supervisor starts a fresh process.
"""

from __future__ import annotations

import logging
import sys

from inferbus_common.lifecycle import run, stop_event_on_signals
from inferbus_common.logs import setup_logging
from inferbus_worker.llm.loopwatch import GcPauses
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.worker import LlmWorker

log = logging.getLogger("inferbus_worker.llm")


async def serve(settings: LlmWorkerSettings) -> int:
    """Serve until SIGTERM or SIGINT (0) or until the worker gives up (1), then drain."""
    stop = stop_event_on_signals()
    worker = LlmWorker(settings, on_fatal=lambda _reason: stop.set())
    with GcPauses():
        async with worker:
            await stop.wait()
    if worker.fatal:
        log.critical("llm worker exits with status 1: %s", worker.fatal)
        return 1
    return 0


def main() -> None:
    """Entry point: build settings once, set up logging, run the event loop."""
    settings = LlmWorkerSettings()
    setup_logging("llm-worker", settings.log_level, settings.log_format)
    status: list[int] = []

    async def _serve() -> None:
        status.append(await serve(settings))

    run(_serve, use_uvloop=settings.use_uvloop, gc_thresholds=settings.gc_thresholds)
    if status and status[0]:
        sys.exit(status[0])


if __name__ == "__main__":
    main()
