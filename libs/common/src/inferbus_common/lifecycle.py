"""Running a service process: event loop choice, signals and the stop event."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


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
