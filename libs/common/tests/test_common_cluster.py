"""On a three-node NATS cluster: the URL list, the replicas of what services
create, and a catalog that keeps following its buckets when a node dies.

A catalog watcher is an ephemeral consumer with one replica, on one node. When
that node dies while the client stays connected to another, nats-py notices
only after two missed idle heartbeats (10-20 s; measured: ~20 s); meanwhile
worker heartbeats would seem to stop. The catalog probes its consumers and
watches again within seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from inferbus_common.audittrail import ensure_audit_stream
from inferbus_common.bus import connect, ensure_batch_stream, replicas_of, server_urls, shutdown
from inferbus_common.catalog import Catalog, WorkerStatus, ensure_kv
from inferbus_common.settings import ServiceSettings
from inferbus_common.subjects import Subjects
from inferbus_testing.servers import NatsCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

S = Subjects("ib")


def test_server_urls_split_a_cluster_list() -> None:
    assert server_urls("nats://a:4222, nats://b:4222,,nats://c:4222") == [
        "nats://a:4222",
        "nats://b:4222",
        "nats://c:4222",
    ]
    with pytest.raises(ValueError, match="no NATS server"):
        server_urls(" , ")


def test_replicas_reach_connect_only_when_not_one() -> None:
    assert "jetstream_replicas" not in ServiceSettings().nats_auth()
    assert ServiceSettings(jetstream_replicas=3).nats_auth() == {"jetstream_replicas": 3}
    with pytest.raises(ValueError):
        ServiceSettings(jetstream_replicas=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    nodes = NatsCluster(Path(tmp_path_factory.mktemp("cluster")), size=3)
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.close()


def _heartbeat(n: int) -> bytes:
    status = WorkerStatus(
        worker_id="w1",
        pool="default",
        models={"m/1": "ready"},
        ts_ms=int(time.time() * 1000) + n,
        host="h",
        pid=n,
    )
    return status.model_dump_json().encode()


async def test_streams_and_buckets_get_the_connections_replicas(cluster: NatsCluster) -> None:
    nc = await connect(cluster.url, "replicas-test", jetstream_replicas=3)
    try:
        js = nc.jetstream()
        assert replicas_of(nc) == replicas_of(js) == 3
        await ensure_batch_stream(js, S)
        await ensure_audit_stream(js, S, max_age_s=60.0, max_bytes=1 << 20)
        await ensure_kv(js, S.routes_bucket)
        for stream in (S.batch_stream, S.audit_stream, f"KV_{S.routes_bucket}"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, stream
    finally:
        await shutdown(nc, 2.0)


async def _catalog_watching_from_another_node(nc: nats.aio.client.Client) -> Catalog:
    """A catalog whose workers-bucket watcher's consumer is not on the client's own node
    (consumers are placed at random: try again until it is elsewhere)."""
    for _ in range(20):
        catalog = Catalog(nc.jetstream(), S)
        await catalog.__aenter__()
        watcher, _task = catalog._watches[S.workers_bucket]
        host = (await watcher._sub.consumer_info()).cluster.leader
        if host != _server_name(nc):
            return catalog
        await catalog.__aexit__(None, None, None)
    raise AssertionError("every watcher landed on the client's own node")


def _server_name(nc: nats.aio.client.Client) -> str:
    """The node the client is connected to (from the server's INFO)."""
    return str(nc._server_info.get("server_name", ""))


async def test_catalog_follows_a_bucket_whose_watcher_node_died(cluster: NatsCluster) -> None:
    nc = await connect(cluster.url, "catalog-cluster-test", jetstream_replicas=3)
    writer = await nats.connect(cluster.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    victim = None
    try:
        # Created through the service's connection: 3 replicas, like every bucket here.
        await ensure_kv(nc.jetstream(), S.workers_bucket)
        kv = await writer.jetstream().key_value(S.workers_bucket)
        catalog = await _catalog_watching_from_another_node(nc)
        try:
            await catalog.wait_loaded()
            await kv.put("w1", _heartbeat(1))
            assert await catalog.wait_for(lambda: "w1" in catalog.workers, 5.0)
            watcher, _task = catalog._watches[S.workers_bucket]
            host = (await watcher._sub.consumer_info()).cluster.leader
            connected = nc.connected_url.port
            victim = cluster.index(host)
            assert cluster.nodes[victim].port != connected
            await asyncio.to_thread(cluster.nodes[victim].kill)
            t_kill = time.monotonic()
            # The bucket's stream keeps two of three replicas: writes go on.
            deadline = t_kill + 20
            n = 2
            while True:
                try:
                    await kv.put("w1", _heartbeat(n))
                    break
                except (nats.errors.Error, nats.js.errors.Error):
                    assert time.monotonic() < deadline, "the bucket took no write"
                    await asyncio.sleep(0.2)
            # The write needed the bucket's stream to have a leader again (an
            # election of 4-9 s when the dead node led it); what is measured is
            # how long after it the catalog has it.
            t_write = time.monotonic()
            seen = await catalog.wait_for(lambda: catalog.workers["w1"].pid == n, 20.0)
            lag = time.monotonic() - t_write
            assert seen, "the catalog stopped following the bucket"
            # The catalog's own probe found the consumer gone and watched again (nats-py's
            # heartbeat-based reset would come 10-20 s after the kill). How fast that was
            # depends on the machine (a loaded CI box stretches the JetStream calls):
            # typically 1-5 s; the bound only catches the catalog waiting for nats-py.
            assert catalog.lost_watches >= 1, "the probe never found the watcher's consumer gone"
            assert lag < 15.0, (
                f"the catalog had the update {lag:.1f} s after it was written "
                f"({t_write - t_kill:.1f} s after the node died)"
            )
            assert nc.connected_url.port == connected  # no reconnect was involved
        finally:
            await catalog.__aexit__(None, None, None)
    finally:
        await writer.close()
        await shutdown(nc, 2.0)
        if victim is not None and not cluster.nodes[victim].running:
            await asyncio.to_thread(cluster.restart, victim)
