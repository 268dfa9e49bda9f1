"""Entry point: ``python -m inferbus_router``."""

from __future__ import annotations

import asyncio
import logging

from inferbus_common import lifecycle, ops
from inferbus_common.bus import connect, shutdown
from inferbus_common.catalog import Catalog
from inferbus_common.subjects import Subjects
from inferbus_router.health import HealthWeights
from inferbus_router.prefix import PlacedForwarder, PrefixTable
from inferbus_router.router import Router
from inferbus_router.settings import RouterSettings
from inferbus_router.shadow import ShadowComparer

log = logging.getLogger("inferbus_router")


async def serve(settings: RouterSettings, stop: asyncio.Event) -> None:
    """Run the router until `stop` (SIGTERM/SIGINT), then drain."""
    instance = settings.instance_id or lifecycle.default_instance_id("router")
    subjects = Subjects(settings.subject_prefix)
    nc = await connect(settings.nats_url, instance, **settings.nats_auth())
    loaded = False
    serving = False

    def ready() -> tuple[bool, str]:
        if not nc.is_connected:
            return False, "not connected to NATS"
        if not loaded:
            return False, "catalog not loaded"
        if not serving:
            return False, "not taking requests (starting or draining)"
        return True, "ok"

    try:
        async with Catalog(nc.jetstream(), subjects) as catalog:
            await catalog.wait_loaded()
            loaded = True
            router = Router(
                nc,
                catalog,
                subjects,
                settings.queue_group,
                health=HealthWeights(settings.health_policy()) if settings.health_enabled else None,
                shadow=ShadowComparer(
                    nc,
                    subjects,
                    instance,
                    timeout_s=settings.shadow_timeout_s,
                    max_pending=settings.shadow_max_pending,
                ),
                health_interval_s=settings.health_interval_s,
                placement=PlacedForwarder(
                    nc,
                    subjects,
                    PrefixTable(settings.prefix_block_chars, settings.prefix_max_blocks),
                )
                if settings.prefix_placement
                else None,
            )
            sock = ops.bind_socket(settings.host, settings.metrics_port)
            async with ops.serve_http(ops.ops_app(ready), sock):
                await router.start()
                serving = True
                ops.write_ports_file(settings.ports_file, {"metrics": sock.getsockname()[1]})
                log.info("router serving", extra={"port": sock.getsockname()[1]})
                await stop.wait()
                serving = False
                log.info("router draining")
                try:
                    await asyncio.wait_for(router.drain(), settings.drain_timeout_s)
                except TimeoutError:
                    log.warning("router drain timed out; closing")
    finally:
        await shutdown(nc, settings.drain_timeout_s)


def main() -> None:
    """Run the router process (settings, logging, tracing, event loop, signals)."""
    lifecycle.service_main("router", RouterSettings, serve)


if __name__ == "__main__":
    main()
