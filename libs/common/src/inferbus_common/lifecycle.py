"""Running a service process: its ``main()`` (`service_main`), event loop choice,
signals and the stop event."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from inferbus_common.logs import setup_logging
from inferbus_common.settings import ServiceSettings

log = logging.getLogger(__name__)

_Settings = TypeVar("_Settings", bound=ServiceSettings)


def default_instance_id(service: str) -> str:
    """``<service>-<host>-<pid>``: unique per process on one machine."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the service then drains and exits)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(
    main: Callable[[], Coroutine[Any, Any, None]],
    *,
    use_uvloop: bool = True,
    gc_thresholds: tuple[int, int, int] | None = None,
) -> None:
    """Run a service's async main on uvloop (when available and wanted).

    A crash in native code (a segfault in an engine, say) prints every
    thread's Python stack to stderr (the service log) before the process dies,
    so it can be told apart from a kill. `gc_thresholds` are set first
    (``ServiceSettings.gc_thresholds``).
    """
    faulthandler.enable()
    if gc_thresholds is not None:
        gc.set_threshold(*gc_thresholds)
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency
            log.warning("uvloop is not installed; using the default asyncio loop")
        else:
            uvloop.run(main())
            return
    asyncio.run(main())


def service_main(
    service: str,
    settings_type: Callable[[], _Settings],
    serve: Callable[[_Settings, asyncio.Event], Awaitable[int | None]],
    *,
    tracing: bool = True,
    prepare: Callable[[_Settings], object] | None = None,
) -> None:
    """The whole ``main()`` of a service process, written once.

    Builds the settings (a bad value fails here, before anything is served),
    sets up logging and, with `tracing`, the tracer; calls `prepare`; then runs
    ``serve(settings, stop)`` on the service's event loop (`run`: uvloop, gc
    thresholds, faulthandler), where `stop` is set by SIGTERM or SIGINT.
    `serve` drains and returns once `stop` is set. Buffered spans are exported
    on the way out, whatever happened.

    Args:
        service: short name (``router``, ``worker`` ...) for logs and spans.
        settings_type: the service's settings class (read from the environment).
        serve: the service's body; a non-zero int it returns becomes the
            process's exit status (the LLM worker's "gave up" is 1).
        tracing: set up `inferbus_common.tracing` (imported only then, so an
            environment without OpenTelemetry can run a service without it).
        prepare: anything to do after logging and before the loop starts
            (registering a metrics collector, say).

    Raises:
        SystemExit: with the status `serve` returned, when not 0.
    """
    settings = settings_type()
    setup_logging(service, settings.log_level, settings.log_format)
    shutdown_tracing: Callable[[], None] | None = None
    if tracing:
        from inferbus_common import tracing as tracer

        tracer.setup_tracing(service, settings, settings.instance_id)
        shutdown_tracing = tracer.shutdown_tracing
    status: list[int | None] = []

    async def body() -> None:
        status.append(await serve(settings, stop_event_on_signals()))

    try:
        if prepare is not None:
            prepare(settings)
        run(body, use_uvloop=settings.use_uvloop, gc_thresholds=settings.gc_thresholds)
    finally:
        if shutdown_tracing is not None:
            shutdown_tracing()
    if status and status[0]:
        sys.exit(status[0])
