"""Latency of one bus hop on this machine: core NATS vs the JetStream work queue.

The "queue" stage at concurrency 1 (batcher → ``IB_BATCHES`` → worker pull) is
about 0.9 ms. This measures the floor under it without any inferbus code: one
real nats-server (loopback), two connections on one uvloop loop, messages sent
one at a time (the next after the previous arrived), p50/p90/p99 in µs::

    uv run python bench/nats_hop.py --count 3000

Hops:

* ``core``: publish on A, delivered to a subscription of B (the request hops
  gateway → router → batcher and worker → gateway are of this kind);
* ``jetstream-pull``: ``js.publish`` on A (its PubAck awaited in a task, as the
  batcher does) into a memory work-queue stream like ``IB_BATCHES``
  (``Nats-Msg-Id`` set, duplicate window on), delivered to B's outstanding
  ``fetch(1)`` long poll, as the worker pulls; the time to the PubAck is
  reported too;
* ``jetstream-pull-file``: the same on a file-storage stream.

One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import nats
import uvloop
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from inferbus_testing.servers import NatsServer


def quantiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 of `values` (seconds) in µs."""
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(1e6 * ordered[min(len(ordered) - 1, int(p * len(ordered)))], 1)

    return {
        "p50_us": q(0.5),
        "p90_us": q(0.9),
        "p99_us": q(0.99),
        "mean_us": round(1e6 * statistics.fmean(ordered), 1),
    }


async def core_hop(url: str, count: int, payload: bytes) -> dict[str, object]:
    a, b = await nats.connect(url), await nats.connect(url)
    got: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: object) -> None:
        got.put_nowait(time.perf_counter())

    await b.subscribe("hop.core", cb=on_msg)
    await b.flush()
    lat = []
    for _ in range(count):
        t0 = time.perf_counter()
        await a.publish("hop.core", payload)
        lat.append(await got.get() - t0)
    await a.close()
    await b.close()
    return {"hop": "core", **quantiles(lat[count // 10 :])}


async def js_hop(url: str, count: int, payload: bytes, storage: StorageType) -> dict[str, object]:
    a, b = await nats.connect(url), await nats.connect(url)
    js_a, js_b = a.jetstream(), b.jetstream()
    name = f"HOP_{storage.value.upper()}"
    await js_a.add_stream(
        StreamConfig(
            name=name,
            subjects=[f"hop.{storage.value}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=storage,
            discard=DiscardPolicy.NEW,
            duplicate_window=120.0,
        )
    )
    subject = f"hop.{storage.value}.m"
    await js_b.add_consumer(
        name,
        ConsumerConfig(durable_name="w", filter_subject=subject, ack_policy=AckPolicy.EXPLICIT),
    )
    psub = await js_b.pull_subscribe_bind(durable="w", stream=name)
    delivered: asyncio.Queue[float] = asyncio.Queue()
    stop = asyncio.Event()

    async def pull() -> None:
        while not stop.is_set():
            try:
                msgs = await psub.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            delivered.put_nowait(time.perf_counter())
            for m in msgs:
                await m.ack()

    puller = asyncio.create_task(pull())
    await asyncio.sleep(0.2)  # the first pull request is out
    lat, acks = [], []
    for i in range(count):
        t0 = time.perf_counter()

        async def store(t0: float = t0, i: int = i) -> None:
            await js_a.publish(subject, payload, headers={"Nats-Msg-Id": f"m{i}"})
            acks.append(time.perf_counter() - t0)

        task = asyncio.create_task(store())
        lat.append(await delivered.get() - t0)
        await task
    stop.set()
    await puller
    await a.close()
    await b.close()
    skip = count // 10
    return {
        "hop": f"jetstream-pull{'-file' if storage is StorageType.FILE else ''}",
        **quantiles(lat[skip:]),
        "puback": quantiles(acks[skip:]),
    }


async def main_async(count: int, size: int) -> list[dict[str, object]]:
    payload = b"x" * size
    with tempfile.TemporaryDirectory(prefix="inferbus-hop-") as tmp:
        with NatsServer(Path(tmp)) as server:
            return [
                await core_hop(server.url, count, payload),
                await js_hop(server.url, count, payload, StorageType.MEMORY),
                await js_hop(server.url, count, payload, StorageType.FILE),
            ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--size", type=int, default=400, help="payload bytes (a fraud micro-batch)")
    args = p.parse_args(argv)
    uvloop.install()
    results = asyncio.run(main_async(args.count, args.size))
    print(json.dumps({"kind": "nats_hop", "count": args.count, "size": args.size, "hops": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
