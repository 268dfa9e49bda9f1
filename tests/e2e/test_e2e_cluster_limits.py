"""Cluster-wide QPS limits exact across three gateway processes sharing one
Redis: offered twice a model's limit, the admitted rate stays within ±5% of
it, every rejection names the limit, and another model is not touched."""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import time

import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_common.admission.keys import AdmissionKeys
from inferbus_common.admission.limits import Limit, Scope, set_limit
from inferbus_testing.processes import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_REDIS = True
LIMIT = 100.0
OFFERED = 2 * LIMIT
WARMUP_S = 0.5
MEASURE_S = 3.0


async def test_three_gateways_hold_the_cluster_limit(stack, tmp_path) -> None:
    from inferbus_client.registry import RegistryClient

    # A second model, unlimited, served in the same run.
    other = tmp_path / "fraud-b"
    shutil.copytree(stack.model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["name"] = "fraud-b"
    (other / "config.json").write_text(json.dumps(cfg))
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(other, "fraud-b", "1", aliases=["stable"])

    assert stack.redis is not None
    redis = aioredis.from_url(stack.redis.url)
    await set_limit(redis, AdmissionKeys("ib"), Limit(Scope.MODEL, "fraud", qps=LIMIT))
    await redis.aclose()

    extra = []
    for i in range(2):
        gw = ServiceProcess(
            "inferbus_gateway",
            name=f"gateway-extra{i}",
            env={
                "INFERBUS_GATEWAY_NATS_URL": stack.nats.url,
                "INFERBUS_GATEWAY_REDIS_URL": stack.redis.url,
                "INFERBUS_GATEWAY_HTTP_PORT": "0",
                "INFERBUS_GATEWAY_GRPC_PORT": "0",
                "INFERBUS_GATEWAY_METRICS_PORT": "0",
            },
            log_dir=stack.base,
        )
        extra.append(gw)
        await gw.astart()
        await gw.await_ready()
    clients = [grpcaio.InferenceServerClient(stack.grpc_url)] + [
        grpcaio.InferenceServerClient(f"127.0.0.1:{gw.ports['grpc']}") for gw in extra
    ]
    try:
        for model in ("fraud", "fraud-b"):
            deadline = time.monotonic() + 30
            while not await clients[0].is_model_ready(model):
                assert time.monotonic() < deadline, f"{model} not ready"
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.2)  # every gateway has loaded the limit

        x = np.zeros((1, 64), np.float32)
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        bad_messages: list[str] = []

        async def one(client, model: str, counted: bool) -> None:
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            try:
                await client.infer(model, [inp], timeout=5_000_000)
                status = "OK"
            except InferenceServerException as exc:
                status = exc.status().removeprefix("StatusCode.")
                if status == "RESOURCE_EXHAUSTED" and "model-qps" not in exc.message():
                    bad_messages.append(exc.message())
            if counted:
                counts[(model, status)] += 1

        tasks = []
        start = time.monotonic()
        n = 0
        # Open loop: OFFERED req/s for fraud spread over the three gateways,
        # and 50 req/s for fraud-b, for warm-up + measurement.
        while (elapsed := time.monotonic() - start) < WARMUP_S + MEASURE_S:
            counted = elapsed >= WARMUP_S
            tasks.append(asyncio.create_task(one(clients[n % 3], "fraud", counted)))
            if n % 4 == 0:
                tasks.append(asyncio.create_task(one(clients[n % 3], "fraud-b", counted)))
            n += 1
            await asyncio.sleep(max(0.0, start + n / OFFERED - time.monotonic()))
        await asyncio.gather(*tasks)
    finally:
        for c in clients:
            await c.close()
        for gw in extra:
            await gw.aterminate()
            gw.cleanup()

    print(dict(counts))
    admitted_rate = counts[("fraud", "OK")] / MEASURE_S
    assert abs(admitted_rate - LIMIT) <= 0.05 * LIMIT, admitted_rate
    assert counts[("fraud", "RESOURCE_EXHAUSTED")] > 0.3 * OFFERED * MEASURE_S
    assert set(status for model, status in counts if model == "fraud") <= {
        "OK",
        "RESOURCE_EXHAUSTED",
    }
    assert bad_messages == []
    # The other model's traffic in the same run is never limited.
    assert set(status for model, status in counts if model == "fraud-b") == {"OK"}
