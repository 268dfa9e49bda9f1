"""``python -m inferbus_registry``: run the registry until SIGTERM/SIGINT."""

from __future__ import annotations

from inferbus_common.lifecycle import run, stop_event_on_signals
from inferbus_common.logs import setup_logging
from inferbus_registry.app import RegistryApp
from inferbus_registry.settings import RegistrySettings


async def serve(settings: RegistrySettings) -> None:
    """Serve until a stop signal, then shut down in order."""
    stop = stop_event_on_signals()
    async with RegistryApp(settings):
        await stop.wait()


def main() -> None:
    """Entry point: settings once, logging, then the event loop."""
    settings = RegistrySettings()
    setup_logging("registry", settings.log_level, settings.log_format)
    run(
        lambda: serve(settings),
        use_uvloop=settings.use_uvloop,
        gc_thresholds=settings.gc_thresholds,
    )


if __name__ == "__main__":
    main()
