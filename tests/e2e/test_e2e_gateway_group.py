"""Several gateway processes on one port (issue 31): both answer requests
spread over several channels (their own counters, seen through the group's
/metrics/group), one Redis QPS limit holds for both together, and a second
group (or a lone gateway) on the taken port fails with a clear error."""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request

import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc.aio as grpcaio
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from inferbus_common.admission.keys import AdmissionKeys
from inferbus_common.admission.limits import Limit, Scope, set_limit
from inferbus_testing.processes import ServiceError, ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_REDIS = True
LIMIT = 60.0
OFFERED = 2 * LIMIT
WARMUP_S = 0.5
MEASURE_S = 3.0
CHANNELS = 16  # all on one process: a 2-in-65536 chance


def _gateway(stack, group_dir, name: str, group: str, grpc: int, http: int) -> ServiceProcess:
    return ServiceProcess(
        "inferbus_gateway",
        name=name,
        env={
            "INFERBUS_GATEWAY_NATS_URL": stack.nats.url,
            "INFERBUS_GATEWAY_REDIS_URL": stack.redis.url,
            "INFERBUS_GATEWAY_HTTP_PORT": str(http),
            "INFERBUS_GATEWAY_GRPC_PORT": str(grpc),
            "INFERBUS_GATEWAY_PORT_GROUP": group,
            "INFERBUS_GATEWAY_METRICS_GROUP": str(group_dir / "gw*.ports.json"),
        },
        log_dir=group_dir,
    )


def _per_process(text: str, family: str) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    counts[s.labels["gateway_process"]] += s.value
    return dict(counts)


async def test_two_gateway_processes_share_a_port(stack, tmp_path) -> None:
    assert stack.redis is not None
    group_dir = tmp_path / "group"
    first = _gateway(stack, group_dir, "gw1", "first", 0, 0)
    await first.astart()
    await first.await_ready()
    grpc_port, http_port = first.ports["grpc"], first.ports["http"]
    second = _gateway(stack, group_dir, "gw2", "join", grpc_port, http_port)
    await second.astart()
    await second.await_ready()
    addr = f"127.0.0.1:{grpc_port}"
    # Channels with equal arguments share one connection (gRPC's global subchannel
    # pool): each needs a pool of its own to get a connection of its own.
    clients = [
        grpcaio.InferenceServerClient(addr, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CHANNELS)
    ]
    try:
        deadline = time.monotonic() + 30
        while not await clients[0].is_model_ready("fraud"):
            assert time.monotonic() < deadline, "fraud not ready"
            await asyncio.sleep(0.05)
        x = np.zeros((1, 64), np.float32)

        async def one(client, counts=None) -> None:
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            try:
                await client.infer("fraud", [inp], timeout=5_000_000)
                status = "OK"
            except InferenceServerException as exc:
                status = exc.status().removeprefix("StatusCode.")
                assert status != "RESOURCE_EXHAUSTED" or "model-qps" in exc.message()
            if counts is not None:
                counts[status] += 1

        # 1. Several channels are spread over both processes by the kernel.
        for _ in range(5):
            await asyncio.gather(*(one(c) for c in clients))
        text = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{first.ports['metrics']}/metrics/group", timeout=5
            )
            .read()
            .decode()
        )
        served = _per_process(text, "inferbus_gateway_requests")
        print(served)
        assert set(served) == {"gw1", "gw2"}, served
        assert all(v > 0 for v in served.values()), served
        assert sum(served.values()) >= 5 * CHANNELS
        # One HELP/TYPE per family, as Prometheus requires.
        helps = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(helps) == len(set(helps))

        # 2. One Redis QPS limit holds for both processes together.
        redis = aioredis.from_url(stack.redis.url)
        await set_limit(redis, AdmissionKeys("ib"), Limit(Scope.MODEL, "fraud", qps=LIMIT))
        await redis.aclose()
        await asyncio.sleep(1.2)  # both have loaded the limit
        counts: collections.Counter[str] = collections.Counter()
        tasks = []
        start = time.monotonic()
        n = 0
        while (elapsed := time.monotonic() - start) < WARMUP_S + MEASURE_S:
            counted = counts if elapsed >= WARMUP_S else None
            tasks.append(asyncio.create_task(one(clients[n % CHANNELS], counted)))
            n += 1
            await asyncio.sleep(max(0.0, start + n / OFFERED - time.monotonic()))
        await asyncio.gather(*tasks)
        print(dict(counts))
        rate = counts["OK"] / MEASURE_S
        assert abs(rate - LIMIT) <= 0.1 * LIMIT, rate
        assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED"}

        # 3. Another group's first process, or a lone gateway, on the taken port fails.
        for group in ("first", "off"):
            intruder = _gateway(stack, tmp_path / "other", f"intruder-{group}", group, grpc_port, 0)
            with pytest.raises(ServiceError):
                await intruder.astart(timeout=30)
            assert "in use" in intruder.log_tail(200).lower(), intruder.log_tail()
            intruder.cleanup()
    finally:
        for c in clients:
            await c.close()
        for gw in (second, first):
            await gw.aterminate()
            gw.cleanup()
