"""The faults of the matrix: what breaks and how it heals (`FAULTS`, `CLUSTER_FAULTS`)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from inferbus_testing.chaos.stack import ChaosStack, ClusterChaosStack
from inferbus_testing.servers import NatsCluster

Action = Callable[[ChaosStack], Awaitable[None]]


@dataclass(frozen=True)
class Fault:
    """Something that breaks (`inject`) and is mended (`heal`) after `hold_s`."""

    name: str
    what: str
    inject: Action
    heal: Action
    hold_s: float = 1.0


def _blocking(fn: Callable[[ChaosStack], Any]) -> Action:
    async def run(stack: ChaosStack) -> None:
        await asyncio.get_running_loop().run_in_executor(stack.spawner, fn, stack)

    return run


async def _nothing(stack: ChaosStack) -> None:
    return None


def _kill(name: str) -> Action:
    return _blocking(lambda s: s.procs[name].kill())


def _restart(name: str) -> Action:
    return _blocking(lambda s: s.restart(name))


def _stop_registry_and_s3(stack: ChaosStack) -> None:
    stack.registry.terminate(timeout=5)
    # Frozen rather than stopped: its port stays open and nothing answers, the
    # harder case for a client (a refused connection fails fast). It also comes
    # back at once, where a SeaweedFS restart takes tens of seconds.
    if stack.s3 is not None and stack.s3.pid is not None:
        os.killpg(stack.s3.pid, signal.SIGSTOP)


def _start_s3_and_registry(stack: ChaosStack) -> None:
    if stack.s3 is not None and stack.s3.pid is not None:
        os.killpg(stack.s3.pid, signal.SIGCONT)
    stack.restart("registry")


def _restart_nats_start(stack: ChaosStack) -> None:
    assert stack.nats is not None
    stack.nats.start()


def _kill_nats(stack: ChaosStack) -> None:
    assert stack.nats is not None
    stack.nats.kill()


def _stop_redis(stack: ChaosStack) -> None:
    assert stack.redis is not None
    stack.redis.stop()


def _start_redis(stack: ChaosStack) -> None:
    assert stack.redis is not None
    stack.redis.start()
    # Redis keeps nothing across a restart (no persistence): put the limit back,
    # as an operator's `inferbus limits` (or a persistent Redis) would.
    stack.set_cluster_limit(1e6)


def _sigstop(name: str) -> Action:
    return _blocking(lambda s: s.procs[name].send_signal(signal.SIGSTOP))


def _sigcont(name: str) -> Action:
    return _blocking(lambda s: s.procs[name].send_signal(signal.SIGCONT))


def _freeze_then_kill(name: str, frozen_s: float = 0.2) -> Action:
    """SIGSTOP `name` (the batches its open pull gets stay with it, un-acked), then
    kill -9 it: it dies holding work in flight."""

    async def run(stack: ChaosStack) -> None:
        stack.procs[name].send_signal(signal.SIGSTOP)
        await asyncio.sleep(frozen_s)
        await asyncio.to_thread(stack.procs[name].kill)

    return run


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "kill-worker",
            "kill -9 one of two workers; restarted after the hold",
            _kill("worker0"),
            _restart("worker0"),
            hold_s=1.0,
        ),
        Fault(
            "kill-busy-worker",
            "kill -9 one of two workers while it holds batches (frozen 0.2 s first); "
            "restarted after the hold",
            _freeze_then_kill("worker0"),
            _restart("worker0"),
            hold_s=1.0,
        ),
        Fault(
            "kill-batcher",
            "kill -9 the only batcher; restarted after the hold",
            _kill("batcher"),
            _restart("batcher"),
            hold_s=1.0,
        ),
        Fault(
            "kill-router",
            "kill -9 the only router; restarted after the hold",
            _kill("router"),
            _restart("router"),
            hold_s=1.0,
        ),
        Fault(
            "kill-gateway",
            "kill -9 one of two gateways (clients fail over); restarted after the hold",
            _kill("gateway"),
            _restart("gateway"),
            hold_s=1.0,
        ),
        Fault(
            "restart-nats",
            "kill -9 nats-server; started again on the same port and JetStream store",
            _blocking(_kill_nats),
            _blocking(_restart_nats_start),
            hold_s=1.0,
        ),
        Fault(
            "restart-redis",
            "stop redis-server (limits fail open); started again",
            _blocking(_stop_redis),
            _blocking(_start_redis),
            hold_s=1.5,
        ),
        Fault(
            "stop-registry-s3",
            "stop the registry, freeze S3 (neither is on the data path); both back after",
            _blocking(_stop_registry_and_s3),
            _blocking(_start_s3_and_registry),
            hold_s=1.5,
        ),
        Fault(
            "sigstop-worker",
            "SIGSTOP one of two workers past its batches' ack wait (0.5 s); SIGCONT after",
            _sigstop("worker0"),
            _sigcont("worker0"),
            hold_s=3.0,
        ),
    ]
}
"""The fault matrix, in the order the report runs it."""

EDGE_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "edge-kill-gateway",
            "kill -9 one of the two gateways behind the edge; restarted after the hold",
            _kill("gateway1"),
            _restart("gateway1"),
            hold_s=1.0,
        ),
        Fault(
            "edge-kill-edge",
            "kill -9 the edge (clients reconnect); restarted on its port after the hold",
            _kill("edge"),
            _restart("edge"),
            hold_s=1.0,
        ),
        replace(FAULTS["kill-worker"], name="edge-kill-worker"),
        replace(FAULTS["restart-nats"], name="edge-restart-nats"),
    ]
}
"""Faults with every client calling through the gRPC edge (`run_fault(through_edge=True)`)."""


async def _data_path_leaders(cluster: NatsCluster, stream: str) -> tuple[str, set[str]]:
    """(leader of `stream`, leaders of the stream and of each of its consumers)."""
    import nats

    urls = [n.url for n in cluster.nodes if n.running]
    nc = await nats.connect(urls, connect_timeout=2, allow_reconnect=False)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        consumers = await js.consumers_info(stream)
    finally:
        await nc.close()
    assert info.cluster is not None and info.cluster.leader
    leaders = {info.cluster.leader}
    leaders.update(c.cluster.leader for c in consumers if c.cluster and c.cluster.leader)
    return info.cluster.leader, leaders


async def _kill_node(stack: ChaosStack, *, leader: bool) -> None:
    """kill -9 the node that leads the work-queue stream (`leader`), or one that
    leads neither the stream nor its consumers (when there is one); remembered in
    `killed_node` for the heal."""
    from inferbus_common.subjects import Subjects

    assert isinstance(stack, ClusterChaosStack)
    cluster = stack.cluster
    lead, busy = await _data_path_leaders(cluster, Subjects().batch_stream)
    if leader:
        victim = cluster.node(lead)
    else:
        idle = [n for n in cluster.nodes if n.server_name not in busy and n.running]
        others = [n for n in cluster.nodes if n.server_name != lead and n.running]
        victim = (idle or others)[0]
    stack.killed_node = cluster.nodes.index(victim)
    await asyncio.get_running_loop().run_in_executor(stack.spawner, victim.kill)


async def _kill_follower_node(stack: ChaosStack) -> None:
    await _kill_node(stack, leader=False)


async def _kill_batch_leader(stack: ChaosStack) -> None:
    await _kill_node(stack, leader=True)


def _restart_killed_node(stack: ChaosStack) -> None:
    assert isinstance(stack, ClusterChaosStack) and stack.killed_node is not None
    # Back on its ports and store; returns once it is current with the cluster.
    stack.cluster.restart(stack.killed_node)
    stack.killed_node = None


CLUSTER_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "kill-nats-node",
            "kill -9 one of three NATS nodes (one that leads neither the work queue "
            "nor its consumers); started again after the hold",
            _kill_follower_node,
            _blocking(_restart_killed_node),
            # Longer than a raft election (nats-server waits 4-9 s for a lost
            # leader), so the two nodes left must serve on their own.
            hold_s=12.0,
        ),
        Fault(
            "kill-stream-leader",
            "kill -9 the NATS node that leads the work-queue stream (a new leader "
            "is elected); started again after the hold",
            _kill_batch_leader,
            _blocking(_restart_killed_node),
            # The stream's and its consumers' raft groups each elect a new leader
            # (4-9 s each, randomized; the JetStream meta group too when the node
            # led it) before micro-batches flow again: 6 s in the reliability run,
            # over 12 s once in CI on a loaded machine.
            hold_s=20.0,
        ),
    ]
}
"""Faults of a three-node NATS cluster (`ClusterChaosStack`), in the order the report runs them."""


# --- one run ------------------------------------------------------------------------
