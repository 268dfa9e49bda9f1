"""The registry is not on the data path: stopped during traffic, serving goes
on; a worker restarted with a warm artifact cache serves without it."""

from __future__ import annotations

import asyncio
import collections
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_testing.processes import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_serving_survives_the_registry_and_a_worker_restart(stack) -> None:
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    x = np.zeros((1, 64), np.float32)
    outcomes: collections.Counter[str] = collections.Counter()

    async def traffic(seconds: float) -> None:
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            try:
                await client.infer("fraud", [inp], timeout=5_000_000)
                outcomes["OK"] += 1
            except InferenceServerException as exc:
                outcomes[exc.status()] += 1

    async def stop_registry() -> None:
        await asyncio.sleep(0.5)
        await stack.registry.aterminate()

    await asyncio.gather(stop_registry(), *(traffic(2.0) for _ in range(4)))
    assert not stack.registry.running
    assert set(outcomes) == {"OK"}, outcomes

    # Restart worker 0 on its warm cache, the registry still down.
    old = stack.workers[0]
    await old.aterminate()
    for w in stack.workers[1:]:
        await w.aterminate()
    warm = ServiceProcess(
        "inferbus_worker",
        name="worker0-warm",
        env={
            **stack.env,
            "INFERBUS_WORKER_NATS_URL": stack.nats.url,
            "INFERBUS_WORKER_REGISTRY_URL": "127.0.0.1:9",  # nothing there
            "INFERBUS_WORKER_CACHE_DIR": str(stack.base / "cache-worker0"),
            "INFERBUS_WORKER_METRICS_PORT": "0",
        },
        log_dir=stack.base,
    )
    await warm.astart()
    try:
        deadline = time.monotonic() + 20
        while True:
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            try:
                result = await client.infer("fraud", [inp], timeout=2_000_000)
                break
            except InferenceServerException:
                assert time.monotonic() < deadline, warm.log_tail()
                await asyncio.sleep(0.1)
        assert result.as_numpy("probabilities").shape == (1, 2)
    finally:
        await warm.aterminate()
        warm.cleanup()
        await client.close()
