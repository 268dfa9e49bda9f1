"""``python -m inferbus_worker``: run a worker until SIGTERM, then drain."""

from __future__ import annotations

from inferbus_common import tracing
from inferbus_common.lifecycle import run, stop_event_on_signals
from inferbus_common.logs import setup_logging
from inferbus_worker.engines.nativelog import relay_native_logs
from inferbus_worker.gpu import register_nvml_collector
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.worker import Worker


async def serve(settings: WorkerSettings) -> None:
    """Serve until SIGTERM or SIGINT, then drain (exit status 0)."""
    stop = stop_event_on_signals()
    async with Worker(settings):
        await stop.wait()


def main() -> None:
    """Entry point: build settings once, set up logging, run the event loop."""
    settings = WorkerSettings()
    setup_logging("worker", settings.log_level, settings.log_format)
    if settings.log_format == "json":
        # ONNX Runtime and TensorRT write to fd 2 themselves: relay them as JSON lines
        # (in the text format their lines are readable as they are).
        relay_native_logs()
    tracing.setup_tracing("worker", settings, settings.instance_id)
    register_nvml_collector()
    try:
        run(
            lambda: serve(settings),
            use_uvloop=settings.use_uvloop,
            gc_thresholds=settings.gc_thresholds,
        )
    finally:
        tracing.shutdown_tracing()


if __name__ == "__main__":
    main()
