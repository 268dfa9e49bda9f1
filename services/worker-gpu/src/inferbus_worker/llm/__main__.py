"""``python -m inferbus_worker.llm``: run an LLM worker until SIGTERM, then drain.

Run it with the vLLM environment's interpreter (``.venvs/vllm/bin/python``).
The ``__main__`` guard matters: vLLM starts its engine in child processes, and
a spawned child re-imports the main module.

Exit status 0 after SIGTERM/SIGINT; 1 when the worker gave up (a dead vLLM
engine that could not be restarted), so its supervisor starts a fresh process.
"""

from __future__ import annotations

import asyncio
import logging

from inferbus_common.lifecycle import service_main
from inferbus_worker.llm.loopwatch import GcPauses
from inferbus_worker.llm.priority import lower_priority
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.worker import LlmWorker

log = logging.getLogger("inferbus_worker.llm")


async def serve(settings: LlmWorkerSettings, stop: asyncio.Event) -> int:
    """Serve until `stop` (SIGTERM or SIGINT: 0) or until the worker gives up (1), then drain."""
    # Before any engine starts: its processes inherit the priority.
    if changed := lower_priority(settings.nice):
        log.info("running at lower CPU priority: %s", ", ".join(changed))
    worker = LlmWorker(settings, on_fatal=lambda _reason: stop.set())
    with GcPauses():
        async with worker:
            await stop.wait()
    if worker.fatal:
        log.critical("llm worker exits with status 1: %s", worker.fatal)
        return 1
    return 0


def main() -> None:
    """Run the LLM worker process (settings, logging, event loop, signals).

    No tracer: the vLLM environment does not install OpenTelemetry.
    """
    service_main("llm-worker", LlmWorkerSettings, serve, tracing=False)


if __name__ == "__main__":
    main()
