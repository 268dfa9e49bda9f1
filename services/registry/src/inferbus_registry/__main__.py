"""``python -m inferbus_registry``: run the registry until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio

from inferbus_common.lifecycle import service_main
from inferbus_registry.app import RegistryApp
from inferbus_registry.settings import RegistrySettings


async def serve(settings: RegistrySettings, stop: asyncio.Event) -> None:
    """Serve until `stop` (SIGTERM/SIGINT), then shut down in order."""
    async with RegistryApp(settings):
        await stop.wait()


def main() -> None:
    """Run the registry process (settings, logging, event loop, signals).

    No tracer: the registry is off the request path and records no spans.
    """
    service_main("registry", RegistrySettings, serve, tracing=False)


if __name__ == "__main__":
    main()
