"""``python -m inferbus_worker``: run a worker until SIGTERM, then drain."""

from __future__ import annotations

import asyncio

from inferbus_common.lifecycle import service_main
from inferbus_worker.engines.nativelog import relay_native_logs
from inferbus_worker.gpu import register_nvml_collector
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.worker import Worker


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    """Serve until `stop` (SIGTERM or SIGINT), then drain (exit status 0)."""
    async with Worker(settings):
        await stop.wait()


def main() -> None:
    """Run the worker process (settings, logging, native log relay, tracing, NVML
    metrics, event loop)."""
    service_main("worker", WorkerSettings, serve, prepare=_prepare)


def _prepare(settings: WorkerSettings) -> None:
    if settings.log_format == "json":
        # ONNX Runtime and TensorRT write to fd 2 themselves: relay them as JSON lines
        # (in the text format their lines are readable as they are).
        relay_native_logs()
    register_nvml_collector()


if __name__ == "__main__":
    main()
