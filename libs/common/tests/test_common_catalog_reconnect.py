"""The catalog follows the buckets again at once after nats-server restarts.

Its watchers are ephemeral consumers that a restarted server no longer has;
nats-py would notice only after two missed idle heartbeats (10-20 s), during
which worker heartbeats seem to stop and every version looks unserved.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from inferbus_common.bus import connect, shutdown
from inferbus_common.catalog import Catalog, WorkerStatus, ensure_kv
from inferbus_common.subjects import Subjects
from inferbus_testing.servers import NatsServer

pytestmark = pytest.mark.integration

S = Subjects("ib")


def _heartbeat(n: int) -> bytes:
    return (
        WorkerStatus(
            worker_id="w1",
            pool="default",
            models={"m/1": "ready"},
            ts_ms=int(time.time() * 1000) + n,
            host="h",
            pid=n,
        )
        .model_dump_json()
        .encode()
    )


async def test_catalog_sees_updates_right_after_a_server_restart(tmp_path) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    nc = await connect(server.url, "catalog-test")
    try:
        async with Catalog(nc.jetstream(), S) as catalog:
            await catalog.wait_loaded()
            writer = await nats.connect(server.url)
            kv = await ensure_kv(writer.jetstream(), S.workers_bucket)
            await kv.put("w1", _heartbeat(1))
            assert await catalog.wait_for(lambda: "w1" in catalog.workers, 5.0)
            await writer.close()

            await server.arestart()
            writer = await nats.connect(server.url)
            kv = await ensure_kv(writer.jetstream(), S.workers_bucket)
            # Until the catalog's client has reconnected, an update cannot reach it.
            deadline = time.monotonic() + 10
            while not nc.is_connected:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await kv.put("w1", _heartbeat(2))
            # Well before nats-py's own heartbeat-based reset (10 s or more).
            seen = await catalog.wait_for(lambda: catalog.workers["w1"].pid == 2, 5.0)
            await writer.close()
            assert seen, "the catalog did not follow the bucket after the restart"
    finally:
        await shutdown(nc, 2.0)
        server.close()
