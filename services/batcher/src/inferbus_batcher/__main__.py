"""Entry point: ``python -m inferbus_batcher`` (or the ``inferbus-batcher`` script)."""

from __future__ import annotations

import contextlib
import logging

from inferbus_batcher.service import Batcher
from inferbus_batcher.settings import BatcherSettings
from inferbus_common import lifecycle, tracing
from inferbus_common.logs import setup_logging
from inferbus_common.ops import bind_socket, ops_app, serve_http, write_ports_file

log = logging.getLogger("inferbus_batcher")


async def serve(settings: BatcherSettings) -> None:
    """Run the batcher until SIGTERM/SIGINT, then drain and exit.

    The ops endpoints start first and stop last, so /readyz reports
    "draining" while queued requests are flushed.
    """
    stop = lifecycle.stop_event_on_signals()
    batcher = Batcher(settings)
    sock = bind_socket(settings.host, settings.metrics_port)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(serve_http(ops_app(batcher.ready), sock))
        await stack.enter_async_context(batcher)
        write_ports_file(settings.ports_file, {"metrics": sock.getsockname()[1]})
        await stop.wait()
        log.info("stopping: draining the batcher")


def main() -> None:
    """Build the settings once, set up logging and run the service."""
    settings = BatcherSettings()
    setup_logging("batcher", settings.log_level, settings.log_format)
    tracing.setup_tracing("batcher", settings, settings.instance_id)
    try:
        lifecycle.run(
            lambda: serve(settings),
            use_uvloop=settings.use_uvloop,
            gc_thresholds=settings.gc_thresholds,
        )
    finally:
        tracing.shutdown_tracing()


if __name__ == "__main__":
    main()
