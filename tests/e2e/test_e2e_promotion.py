"""Promote v2 over v1 under steady traffic: zero failed requests, v2 answers
within seconds of the alias change, v1 is unloaded after its grace period."""

from __future__ import annotations

import asyncio
import collections
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_ENV = {"INFERBUS_WORKER_UNLOAD_GRACE_S": "1.5"}


async def test_promote_v2_with_zero_failed_requests(stack) -> None:
    from inferbus_client.registry import RegistryClient

    client = grpcaio.InferenceServerClient(stack.grpc_url)
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(stack.model_dir, "fraud", "2")  # `latest` → 2, stable stays 1
        deadline = time.monotonic() + 30
        while not await client.is_model_ready("fraud", "2"):
            assert time.monotonic() < deadline, "v2 never became ready"
            await asyncio.sleep(0.05)

        x = np.zeros((1, 64), np.float32)
        seen: list[tuple[float, str]] = []
        failures: collections.Counter[str] = collections.Counter()
        stop_at = time.monotonic() + 4.0

        async def sender() -> None:
            while time.monotonic() < stop_at:
                inp = grpcaio.InferInput("input", [1, 64], "FP32")
                inp.set_data_from_numpy(x)
                try:
                    result = await client.infer("fraud", [inp], timeout=5_000_000)
                except InferenceServerException as exc:
                    failures[exc.status()] += 1
                    continue
                seen.append((time.monotonic(), result.get_response().model_version))

        async def promote() -> float:
            await asyncio.sleep(1.0)
            t = time.monotonic()
            await registry.set_alias("fraud", "stable", "2")
            return t

        results = await asyncio.gather(promote(), *(sender() for _ in range(8)))
    promoted_at = results[0]
    assert failures == collections.Counter(), failures
    versions = [v for _, v in seen]
    assert versions[0] == "1" and versions[-1] == "2"
    first_v2 = min(t for t, v in seen if v == "2")
    switch_s = first_v2 - promoted_at
    print(f"{len(seen)} requests, v2 first answered {switch_s * 1000:.0f} ms after promotion")
    assert switch_s < 3.0
    # Once the route moved, nothing is answered by v1 any more (after a short settle).
    assert all(v == "2" for t, v in seen if t > promoted_at + 1.0)
    # v1 is unloaded after the grace period.
    deadline = time.monotonic() + 15
    while await client.is_model_ready("fraud", "1"):
        assert time.monotonic() < deadline, "v1 was never unloaded"
        await asyncio.sleep(0.1)
    await client.close()
