"""Entry point: ``python -m inferbus_batcher`` (or the ``inferbus-batcher`` script)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from inferbus_batcher.service import Batcher
from inferbus_batcher.settings import BatcherSettings
from inferbus_common.lifecycle import service_main
from inferbus_common.ops import bind_socket, ops_app, serve_http, write_ports_file

log = logging.getLogger("inferbus_batcher")


async def serve(settings: BatcherSettings, stop: asyncio.Event) -> None:
    """Run the batcher until `stop` (SIGTERM/SIGINT), then drain and exit.

    The ops endpoints start first and stop last, so /readyz reports
    "draining" while queued requests are flushed.
    """
    batcher = Batcher(settings)
    sock = bind_socket(settings.host, settings.metrics_port)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(serve_http(ops_app(batcher.ready), sock))
        await stack.enter_async_context(batcher)
        write_ports_file(settings.ports_file, {"metrics": sock.getsockname()[1]})
        await stop.wait()
        log.info("stopping: draining the batcher")


def main() -> None:
    """Run the batcher process (settings, logging, tracing, event loop, signals)."""
    service_main("batcher", BatcherSettings, serve)


if __name__ == "__main__":
    main()
