"""Make-before-break for the ``stable`` alias: the version that serves keeps serving
until the one it was moved to is ready on a worker.

`traffic.hold_stable` is applied to every catalog write of a route: when ``stable``
moves to a version no live worker reports ready while the previous one is
served, the route keeps the previous one as `Route.stable` and names the new
one `Route.stable_pending` (workers load it). `PromotionWatcher` completes the
move once a worker reports it ready, or abandons it (``stable`` moves back,
event ``promotion_abandoned``) when a worker refuses the version for good or
``promotion_timeout_s`` passes. See docs/architecture.md ("Route writes").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
import nats.js.errors

from inferbus_common.catalog import Catalog, Route
from inferbus_common.catalogrecords import is_rejected
from inferbus_common.errors import InferbusError
from inferbus_registry.publisher import CatalogPublisher
from inferbus_registry.repository import ModelRepository
from inferbus_registry.traffic import now_ms

log = logging.getLogger(__name__)


class PromotionWatcher:
    """Completes or abandons the pending ``stable`` promotions (see module docstring).

    Args:
        catalog: the registry's live view of routes and worker heartbeats.
        repo: the model repository (the ``stable`` alias).
        publisher: writes routes and events.
        timeout_s: how long a promotion may wait for its version to be ready.
        tick_s: how often pending promotions are looked at without a catalog change.
    """

    def __init__(
        self,
        catalog: Catalog,
        repo: ModelRepository,
        publisher: CatalogPublisher,
        *,
        timeout_s: float,
        tick_s: float = 0.5,
    ) -> None:
        self._catalog = catalog
        self._repo = repo
        self._publisher = publisher
        self._timeout_ms = int(timeout_s * 1000)
        self._tick_s = tick_s
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Look at pending promotions now (the catalog changed)."""
        self._wake.set()

    def start(self) -> None:
        """Start the owned loop."""
        self._task = asyncio.create_task(self._run(), name="promotions")

    async def stop(self) -> None:
        """Stop the loop (bounded, idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            for route in [r for r in self._catalog.routes.values() if r.stable_pending]:
                try:
                    await self.settle(route)
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                    log.warning(
                        "promotion check failed (NATS): %s", exc, extra={"model": route.model}
                    )
                except InferbusError as exc:
                    log.warning("promotion check failed: %s", exc, extra={"model": route.model})
                except Exception:
                    log.exception("promotion check failed", extra={"model": route.model})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._tick_s):
                    await self._wake.wait()

    async def settle(self, route: Route) -> None:
        """Complete `route`'s pending promotion if its version is ready, abandon it
        when a worker refuses the version or the timeout passed; else wait."""
        model, target = route.model, route.stable_pending
        state = self._catalog.version_state(model, target)
        waited_ms = now_ms() - route.stable_pending_since_unix_ms
        if state == "ready":
            await self._publisher.publish_route(self._repo, await self._repo.state(model))
            log.info("promotion completed: %s is stable", target, extra={"model": model})
            await self._publisher.event(model, "promotion_completed", version=target)
            return
        if not is_rejected(state) and waited_ms < self._timeout_ms:
            return
        why = state if is_rejected(state) else f"not ready after {waited_ms / 1000:.0f}s ({state})"
        repo_state = await self._repo.state(model)
        if repo_state.aliases.get("stable") == target:
            repo_state = await self._repo.set_alias(model, "stable", route.stable)
        await self._publisher.publish_route(self._repo, repo_state)
        log.warning(
            "promotion of %s abandoned, %s stays stable: %s",
            target,
            route.stable,
            why,
            extra={"model": model, "version": target},
        )
        await self._publisher.event(
            model, "promotion_abandoned", version=target, stable=route.stable, reason=why
        )
