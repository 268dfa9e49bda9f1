"""``python -m inferbus_worker.llm``: run an LLM worker until SIGTERM, then drain.

Run it with the vLLM environment's interpreter (``.venvs/vllm/bin/python``).
The ``__main__`` guard matters: vLLM starts its engine in child processes, and
a spawned child re-imports the main module.
"""

from __future__ import annotations

from inferbus_common.lifecycle import run, stop_event_on_signals
from inferbus_common.logs import setup_logging
from inferbus_worker.llm.service import LlmWorker
from inferbus_worker.llm.settings import LlmWorkerSettings


async def serve(settings: LlmWorkerSettings) -> None:
    """Serve until SIGTERM or SIGINT, then drain (exit status 0)."""
    stop = stop_event_on_signals()
    async with LlmWorker(settings):
        await stop.wait()


def main() -> None:
    """Entry point: build settings once, set up logging, run the event loop."""
    settings = LlmWorkerSettings()
    setup_logging("llm-worker", settings.log_level, settings.log_format)
    run(lambda: serve(settings), use_uvloop=settings.use_uvloop)


if __name__ == "__main__":
    main()
