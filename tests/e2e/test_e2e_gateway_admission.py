"""The gateway's front door on a real stack with a real redis-server:
API-key authentication, model QPS limits, and the circuit breaker answering
with a model's fallback while its workers are frozen."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.keys import AdmissionKeys
from inferbus_common.admission.limits import Limit, Scope, delete_limit, set_limit

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_REDIS = True
STACK_ENV = {
    "INFERBUS_GATEWAY_AUTH_ENABLED": "true",
    "INFERBUS_GATEWAY_BREAKER_WINDOW_S": "5",
    "INFERBUS_GATEWAY_BREAKER_MIN_REQUESTS": "3",
    "INFERBUS_GATEWAY_BREAKER_OPEN_S": "1",
    "INFERBUS_GATEWAY_BREAKER_HALF_OPEN_PROBES": "1",
}

KEYS = AdmissionKeys("ib")


async def _store(stack) -> tuple[aioredis.Redis, KeyStore]:
    client = aioredis.from_url(stack.redis.url)
    return client, KeyStore(client, KEYS)


async def _new_key(stack, tenant: str, *models: str) -> str:
    client, store = await _store(stack)
    try:
        _, secret = await store.create_key(tenant)
        if models:
            await store.allow_models(tenant, *models)
        return secret
    finally:
        await client.aclose()


def _inp(rows: int = 1) -> grpcclient.InferInput:
    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    inp = grpcclient.InferInput("input", [rows, 64], "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _status(client, model: str, **kw) -> str:
    try:
        client.infer(model, [_inp()], **kw)
    except InferenceServerException as exc:
        return exc.status().removeprefix("StatusCode.")
    return "OK"


async def test_api_keys_access_lists_and_revocation(stack) -> None:
    secret = await _new_key(stack, "acme", "fraud")
    other = await _new_key(stack, "globex")  # no models allowed
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        assert _status(client, "fraud") == "UNAUTHENTICATED"
        assert _status(client, "fraud", headers={"x-api-key": "ib_not-a-key"}) == (
            "UNAUTHENTICATED"
        )
        assert _status(client, "fraud", headers={"x-api-key": secret}) == "OK"
        assert _status(client, "fraud", headers={"authorization": f"Bearer {secret}"}) == "OK"
        assert _status(client, "fraud", headers={"x-api-key": other}) == "PERMISSION_DENIED"

        r = httpx.post(
            f"http://{stack.http_url}/v2/models/fraud/infer",
            json={
                "inputs": [
                    {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
                ]
            },
        )
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"

        redis_client, store = await _store(stack)
        try:
            records = await store.list_keys("acme")
            await store.revoke_key(records[0].key_id)
        finally:
            await redis_client.aclose()
        deadline = time.monotonic() + 5
        while _status(client, "fraud", headers={"x-api-key": secret}) == "OK":
            assert time.monotonic() < deadline, "revoked key still accepted after 5 s"
            await asyncio.sleep(0.1)
        assert _status(client, "fraud", headers={"x-api-key": secret}) == "UNAUTHENTICATED"
    finally:
        client.close()
    log = stack.gateway.log_path.read_text()
    assert secret not in log and other not in log


async def test_model_limit_rejects_with_reason_and_is_lifted_at_run_time(stack) -> None:
    secret = await _new_key(stack, "acme-limits", "fraud")
    redis_client = aioredis.from_url(stack.redis.url)
    await set_limit(redis_client, KEYS, Limit(Scope.MODEL, "fraud", qps=10, burst=5))
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    try:
        await asyncio.sleep(1.2)  # gateways reload limits within a second

        async def one() -> str:
            try:
                await client.infer("fraud", [_inp()], headers={"x-api-key": secret})
            except InferenceServerException as exc:
                assert "model-qps" in exc.message()
                return exc.status()
            return "OK"

        outcomes = await asyncio.gather(*(one() for _ in range(60)))
        assert outcomes.count("StatusCode.RESOURCE_EXHAUSTED") >= 40
        assert 1 <= outcomes.count("OK") <= 20

        r = httpx.post(
            f"http://{stack.http_url}/v2/models/fraud/infer",
            headers={"x-api-key": secret},
            json={
                "inputs": [
                    {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
                ]
                * 1
            },
        )
        if r.status_code == 429:
            assert r.headers["x-inferbus-reason"] == "model-qps"
            assert int(r.headers["retry-after"]) >= 1

        await delete_limit(redis_client, KEYS, Scope.MODEL, "fraud")
        await asyncio.sleep(1.2)
        outcomes = await asyncio.gather(*(one() for _ in range(30)))
        assert outcomes.count("OK") == 30
    finally:
        await client.close()
        await redis_client.aclose()


async def test_breaker_opens_answers_fallback_and_recovers(stack, tmp_path) -> None:
    from inferbus_client.registry import RegistryClient

    model_dir = tmp_path / "fraud-fb"
    shutil.copytree(stack.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["name"] = "fraud-fb"
    config["fallback"] = {"outputs": {"probabilities": [1.0, 0.0]}}
    (model_dir / "config.json").write_text(json.dumps(config))
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(model_dir, "fraud-fb", "1", aliases=["stable"])
    secret = await _new_key(stack, "acme-fb", "fraud-fb")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    hdr = {"x-api-key": secret}
    deadline = time.monotonic() + 60
    while not client.is_model_ready("fraud-fb"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert (
        client.infer("fraud-fb", [_inp()], headers=hdr)
        .get_response()
        .parameters.get("inferbus_degraded")
        is None
    )

    def degraded(result) -> str:
        p = result.get_response().parameters
        return p["inferbus_degraded"].string_param if "inferbus_degraded" in p else ""

    for w in stack.workers:
        w.send_signal(signal.SIGSTOP)
    try:
        reasons = []
        while "breaker-open" not in reasons:
            assert len(reasons) < 6, reasons
            result = client.infer("fraud-fb", [_inp()], headers=hdr, timeout=300_000)
            reasons.append(degraded(result))
            np.testing.assert_allclose(result.as_numpy("probabilities"), [[1.0, 0.0]])
        # Timeouts first (answered by the fallback), then the breaker opened.
        assert reasons[0] == "deadline"
        assert set(reasons[:-1]) == {"deadline"}
        # The breaker is open: answers come at once, without waiting for a deadline.
        t0 = time.monotonic()
        result = client.infer("fraud-fb", [_inp(2)], headers=hdr, timeout=300_000)
        assert degraded(result) == "breaker-open"
        assert time.monotonic() - t0 < 0.2
        assert result.as_numpy("probabilities").tolist() == [[1.0, 0.0], [1.0, 0.0]]
        r = httpx.post(
            f"http://{stack.http_url}/v2/models/fraud-fb/infer",
            headers=hdr,
            json={
                "inputs": [
                    {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
                ]
            },
        )
        assert r.status_code == 200 and r.headers["x-inferbus-degraded"] == "breaker-open"
    finally:
        for w in stack.workers:
            w.send_signal(signal.SIGCONT)
    # Workers heal; after the open period one probe closes the breaker again.
    deadline = time.monotonic() + 15
    while True:
        await asyncio.sleep(0.3)
        result = client.infer("fraud-fb", [_inp()], headers=hdr)
        if not degraded(result):
            break
        assert time.monotonic() < deadline, "breaker never closed after the workers healed"
    for _ in range(5):
        assert degraded(client.infer("fraud-fb", [_inp()], headers=hdr)) == ""
    client.close()


async def test_backup_model_answers_when_the_model_cannot(stack, tmp_path) -> None:
    from inferbus_client.registry import RegistryClient

    # Placed on a pool with no workers: never ready, so the backup answers.
    model_dir = tmp_path / "fraud-bk"
    shutil.copytree(stack.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(name="fraud-bk", pool="nowhere", fallback={"model": "fraud"})
    (model_dir / "config.json").write_text(json.dumps(config))
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(model_dir, "fraud-bk", "1", aliases=["stable"])
    secret = await _new_key(stack, "acme-bk", "fraud-bk")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                result = client.infer("fraud-bk", [_inp(2)], headers={"x-api-key": secret})
                break
            except InferenceServerException as exc:
                # Until the gateway's catalog has the new model: NOT_FOUND.
                assert exc.status() == "StatusCode.NOT_FOUND", exc
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        params = result.get_response().parameters
        # No worker of pool 'nowhere' serves it: the "no worker" answer, covered
        # by the fallback (dispatch/noworker.py).
        assert params["inferbus_degraded"].string_param == (
            "no-worker; answered by fraud version 1"
        )
        assert result.as_numpy("probabilities").shape == (2, 2)
    finally:
        client.close()
