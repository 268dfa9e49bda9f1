"""Lazy loading: the gateway asks workers to load a version when a request needs it.

A version whose config says ``load_policy: lazy`` is routed but not loaded:
its workers report it ``lazy`` in their heartbeat. Workers see requests only
through the JetStream work queue, and the gateway refuses requests for a
version no worker reports ready before they ever reach a queue, so the
trigger lives here, where the first request is seen: the gateway publishes a
load hint (``<prefix>.loadhint.<model>.<version>``, JSON ``{model, version}``)
that every worker receives; those whose pool serves the version load it.

The request that caused it waits for ``ready`` up to half its deadline (capped
by `max_wait_s`), re-sending the hint every `hint_interval_s` (core NATS:
a hint may be lost, e.g. the first message after a worker subscribes, or sent
before a worker has seen the route). If the version is ready in time the
request is served; if not it gets UNAVAILABLE "loading, retry" while the load
goes on, and the retry is served once the worker is ready.
"""

from __future__ import annotations

import json
import logging
import time

from nats.aio.client import Client
from prometheus_client import Counter

from inferbus_common.catalog import Catalog
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

LOAD_HINTS = Counter(
    "inferbus_gateway_load_hints_total",
    "Load hints published for lazy versions, by model.",
    ["model"],
)


class LazyLoader:
    """Publishes load hints and waits for lazy versions to become ready.

    Args:
        nc: connected NATS client.
        catalog: the gateway's live catalog (worker states).
        subjects: naming scheme.
        hint_interval_s: least time between two hints for one version.
        max_wait_s: longest a request waits for a lazy load.
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        subjects: Subjects,
        *,
        hint_interval_s: float = 1.0,
        max_wait_s: float = 30.0,
    ) -> None:
        self._nc = nc
        self._catalog = catalog
        self._subjects = subjects
        self._interval = hint_interval_s
        self._max_wait = max_wait_s
        self._last_hint: dict[tuple[str, str], float] = {}

    async def hint(self, model: str, version: str) -> None:
        """Publish a load hint for (model, version), at most once per interval."""
        key = (model, version)
        now = time.monotonic()
        if now - self._last_hint.get(key, float("-inf")) < self._interval:
            return
        self._last_hint[key] = now
        body = json.dumps({"model": model, "version": version}).encode()
        await self._nc.publish(self._subjects.load_hint(model, version), body)
        LOAD_HINTS.labels(model).inc()
        log.info("load hint sent", extra={"model": model, "version": version})

    async def wait_ready(self, model: str, version: str, timeout_s: float) -> str:
        """Hint and wait until the version is ``ready`` or has failed; its last state.

        Re-sends the hint while waiting. Never waits past `timeout_s` (nor
        `max_wait_s`).
        """
        deadline = time.monotonic() + min(timeout_s, self._max_wait)

        def settled() -> bool:
            state = self._catalog.version_state(model, version)
            return state == "ready" or state.startswith("failed")

        while True:
            await self.hint(model, version)
            left = deadline - time.monotonic()
            if settled() or left <= 0:
                break
            await self._catalog.wait_for(settled, min(left, self._interval))
        return self._catalog.version_state(model, version)

    async def hint_traffic(self, model: str) -> None:
        """Hint the route's lazy canary and shadow versions that are not ready.

        The router, not the gateway, sends requests to them, so the gateway
        cannot wait for them; it only makes sure their load starts.
        """
        route = self._catalog.routes.get(model)
        if route is None or not (route.canary or route.shadow):
            return
        for version in (route.canary, route.shadow):
            dv = self._catalog.versions.get((model, version)) if version else None
            if (
                dv is not None
                and dv.config.load_policy == "lazy"
                and self._catalog.version_state(model, version) != "ready"
            ):
                await self.hint(model, version)

    async def request_wait(self, model: str, version: str, timeout_s: float) -> str:
        """What a request does: wait up to half its deadline for the lazy version."""
        return await self.wait_ready(model, version, max(0.0, timeout_s / 2))
