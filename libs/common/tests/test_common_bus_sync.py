"""`inferbus_common.bus.sync`: the round trip that follows what the connection sent.

A real nats-server with protocol tracing (``-V``) logs every command it reads from
a connection, in order, so the test sees the order on the wire.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats

from inferbus_common import bus
from inferbus_testing.servers import NatsServer


def _commands(log: Path, name: str) -> list[str]:
    """What nats-server read from the connection called `name`, in order."""
    out = []
    for line in log.read_text().splitlines():
        if f":{name}" in line and "<<- [" in line:
            out.append(line.split("<<- [", 1)[1].rstrip("]"))
    return out


async def test_sync_pings_behind_the_subscriptions_a_plain_flush_overtakes(
    tmp_path: Path,
) -> None:
    with NatsServer(tmp_path, extra_args=["-V"]) as server:
        nc = await nats.connect(server.url, name="sync-probe")
        try:
            await nc.subscribe("probe.flushed")
            await nc.flush()
            await nc.subscribe("probe.synced")
            await bus.sync(nc)
            # Both round trips are over: the server has logged what it read.
            sent = _commands(server.log_path, "sync-probe")
        finally:
            await nc.close()
    subs = [i for i, c in enumerate(sent) if c.startswith("SUB ")]
    pings = [i for i, c in enumerate(sent) if c == "PING"]
    assert [sent[i].split()[1] for i in subs] == ["probe.flushed", "probe.synced"], sent
    flushed, synced = subs
    # Why sync exists: nats-py's flush() wrote its PING ahead of the SUB queued
    # before it (the connect handshake's PING and the flush's both precede that
    # SUB). If this starts to fail, nats-py orders its PING behind queued
    # commands and one flush is a barrier again.
    assert len([p for p in pings if p < flushed]) == 2, sent
    # sync's second round trip follows the subscription made before it.
    assert [p for p in pings if p > synced], sent


async def test_sync_raises_on_a_closed_connection(tmp_path: Path) -> None:
    with NatsServer(tmp_path) as server:
        nc = await nats.connect(server.url)
        await nc.close()
        try:
            await asyncio.wait_for(bus.sync(nc), 5)
        except nats.errors.ConnectionClosedError:
            return
    raise AssertionError("sync on a closed connection returned")
