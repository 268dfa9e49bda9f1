"""The batcher's readiness (what /readyz serves) is false until it can take requests:
connected, work-queue stream ensured, catalog loaded and subscribed; false again once
it drains. Real nats-server; `ready()` is sampled on every turn of the event loop
while the batcher starts, so a regression that reports ready early is seen."""

from __future__ import annotations

import asyncio

from inferbus_batcher.service import Batcher
from inferbus_batcher.settings import BatcherSettings
from inferbus_testing.servers import NatsServer

START_REASONS = {
    "not connected to NATS",
    "micro-batch stream not ensured yet",
    "catalog not loaded yet",
    "not subscribed to requests yet",
}


async def test_ready_only_once_subscribed_and_not_while_draining(nats_server: NatsServer) -> None:
    batcher = Batcher(
        BatcherSettings(
            nats_url=nats_server.url,
            subject_prefix="brd",
            instance_id="batcher-ready",
            metrics_port=0,
            use_uvloop=False,
            drain_timeout_s=5,
            stream_max_bytes=8 << 20,
        )
    )
    assert batcher.ready() == (False, "not connected to NATS")
    samples: list[tuple[bool, str, bool]] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            ok, reason = batcher.ready()
            samples.append((ok, reason, batcher._sub is not None))
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    try:
        async with batcher:
            assert batcher.ready() == (True, "ok")
            await asyncio.sleep(0.01)
            await batcher.drain()
            assert batcher.ready() == (False, "draining")
    finally:
        stop.set()
        await sampler
    assert batcher.ready()[0] is False
    ready = [s for s in samples if s[0]]
    assert ready and all(subscribed for _, _, subscribed in ready)
    assert {reason for ok, reason, _ in samples if not ok} <= START_REASONS | {"draining"}
    print(f"ready() sampled {len(samples)} times, {len(samples) - len(ready)} not ready")
