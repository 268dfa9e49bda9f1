"""A corrupt artifact never takes traffic: the registry refuses to promote it, and
forced through a route or an alias, the previous version keeps serving every
request while the workers refuse the bad one for good (issue 21)."""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_common.catalog import Route
from inferbus_common.errors import FailedPrecondition

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_ENV = {
    "INFERBUS_WORKER_LOAD_RETRY_S": "1",
    "INFERBUS_WORKER_UNLOAD_GRACE_S": "1",
}


async def _states(stack, key: str) -> list[str]:
    """The state of `key` (``model/version``) each worker reports on /readyz."""
    out = []
    async with httpx.AsyncClient() as client:
        for worker in stack.workers:
            reason = (await client.get(f"http://127.0.0.1:{worker.ports['metrics']}/readyz")).json()
            for part in reason["reason"].split("; "):
                if part.startswith(f"{key}: "):
                    out.append(part[len(key) + 2 :])
    return out


async def _until(what: str, check, timeout: float = 40.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.1)


async def test_corrupt_version_is_refused_and_forcing_it_fails_no_request(stack, tmp_path) -> None:
    from inferbus_client.registry import RegistryClient

    # v2: the same model, loaded lazily so no worker caches it before it is corrupted.
    v2_dir = tmp_path / "fraud-v2"
    shutil.copytree(stack.model_dir, v2_dir)
    config = json.loads((v2_dir / "config.json").read_text())
    (v2_dir / "config.json").write_text(json.dumps({**config, "load_policy": "lazy"}))
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(v2_dir, "fraud", "2")
        stored = stack.base / "store/models/fraud/2/model.onnx"
        data = bytearray(stored.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stored.write_bytes(bytes(data))

        # 1. Every way of pointing traffic at it is refused, naming the mismatch.
        for attempt in (
            registry.set_alias("fraud", "stable", "2"),
            registry.set_traffic("fraud", canary="2", canary_weight=10),
            registry.start_rollout("fraud", "2", steps=[50, 100], interval_s=1),
        ):
            with pytest.raises(FailedPrecondition) as refused:
                await attempt
            assert "model.onnx" in refused.value.message
            assert "does not match its manifest" in refused.value.message

        # 2. Forced through, under steady unpinned traffic.
        x = np.zeros((1, 64), np.float32)
        served: collections.Counter[str] = collections.Counter()
        failures: collections.Counter[str] = collections.Counter()
        done = asyncio.Event()

        async def sender() -> None:
            while not done.is_set():
                inp = grpcaio.InferInput("input", [1, 64], "FP32")
                inp.set_data_from_numpy(x)
                try:
                    result = await client.infer("fraud", [inp], timeout=5_000_000)
                except InferenceServerException as exc:
                    failures[f"{exc.status()}: {exc.message()}"] += 1
                    continue
                served[result.get_response().model_version] += 1

        senders = [asyncio.create_task(sender()) for _ in range(4)]
        try:
            # 2a. A canary taking every unpinned request: the routers send it nothing
            # while no worker serves it, and the workers refuse it for good.
            await registry.set_traffic(
                "fraud", canary="2", canary_weight=100, force=True, updated_by="test"
            )

            async def refused_for_good() -> bool:
                return any(
                    s.startswith("failed permanently") for s in await _states(stack, "fraud/2")
                )

            await _until("a worker refuses v2 for good", refused_for_good)
            state = (await _states(stack, "fraud/2"))[0]
            assert "SHA-256" in state, state
            # A request pinned to it is answered with the reason, not "retry".
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException) as pinned:
                await client.infer("fraud", [inp], model_version="2", timeout=5_000_000)
            assert "failed permanently" in pinned.value.message()
            assert pinned.value.status() == "StatusCode.FAILED_PRECONDITION", pinned.value.message()
            await asyncio.sleep(1.0)  # more traffic while the bad canary is in the route
            await registry.set_traffic("fraud", canary="", updated_by="test")

            # 2b. The stable alias moved by force: held on 1 until 2 is ready, then
            # the promotion is abandoned because the workers refuse 2.
            await registry.set_alias("fraud", "stable", "2", force=True)

            async def abandoned() -> bool:
                route = Route.model_validate_json((await registry.get_route("fraud")).route_json)
                models = {m.name: m for m in await registry.list_models()}
                return (
                    route.stable == "1"
                    and not route.stable_pending
                    and models["fraud"].aliases["stable"] == "1"
                )

            await _until("the forced promotion is abandoned", abandoned)
            await asyncio.sleep(1.0)
        finally:
            done.set()
            await asyncio.gather(*senders)
    await client.close()
    print(f"served {dict(served)}, failed {dict(failures)}")
    assert failures == collections.Counter(), failures
    assert set(served) == {"1"} and served["1"] > 50, served
