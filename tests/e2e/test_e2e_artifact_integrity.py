"""Signed artifacts end to end: the registry signs every push, workers trust
only its key; a tampered stored file, an edited catalog entry or a foreign
signature is refused with a reason, and what already serves keeps serving."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import nats
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cryptography.hazmat.primitives import serialization

from inferbus_common.catalog import DeployedVersion, Route, ensure_kv
from inferbus_common.signing import generate_key, sign, signed_payload
from inferbus_common.subjects import Subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_KEY_DIR = Path(tempfile.mkdtemp(prefix="ib-signing-"))
_PEM, _PUB = generate_key()
(_KEY_DIR / "registry.pem").write_bytes(_PEM)
STACK_ENV = {
    "INFERBUS_REGISTRY_SIGNING_KEY_FILE": str(_KEY_DIR / "registry.pem"),
    "INFERBUS_REGISTRY_SIGNING_KEY_ID": "registry-2026",
    "INFERBUS_WORKER_TRUSTED_KEYS": json.dumps([f"registry-2026={_PUB}"]),
}


def _serves(stack, model: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        inp = grpcclient.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(np.ones((1, 64), np.float32))
        return client.infer(model, [inp]).as_numpy("probabilities")
    finally:
        client.close()


async def _worker_state(port: int, model: str, version: str, want: str, timeout: float) -> str:
    """Poll a worker's /readyz reason until it mentions `want` for the version."""
    deadline = time.monotonic() + timeout
    reason = ""
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            reason = (await client.get(f"http://127.0.0.1:{port}/readyz")).json()["reason"]
            if f"{model}/{version}" in reason and want in reason:
                return reason
            await asyncio.sleep(0.1)
    raise AssertionError(f"worker never reported {want!r} for {model}/{version}: {reason}")


async def test_signed_version_serves_and_carries_its_signature(stack) -> None:
    assert _serves(stack, "fraud").shape == (1, 2)
    nc = await nats.connect(stack.nats.url)
    try:
        kv = await ensure_kv(nc.jetstream(), Subjects().models_bucket)
        dv = DeployedVersion.model_validate_json((await kv.get("fraud.1")).value)
    finally:
        await nc.close()
    assert dv.key_id == "registry-2026" and dv.signature
    manifest = json.loads((stack.base / "store/models/fraud/1/manifest.json").read_text())
    assert manifest["signature"]["alg"] == "ed25519"
    assert manifest["signature"]["value"] == dv.signature


async def test_edited_catalog_or_foreign_signature_is_refused(stack) -> None:
    nc = await nats.connect(stack.nats.url)
    subjects = Subjects()
    try:
        js = nc.jetstream()
        models = await ensure_kv(js, subjects.models_bucket)
        routes = await ensure_kv(js, subjects.routes_bucket)
        real = DeployedVersion.model_validate_json((await models.get("fraud.1")).value)
        # 1. Same files, but the catalog claims another digest for the model file.
        edited = real.model_copy(
            update={"model": "fraud-edit", "files": {**real.files, "model.onnx": "0" * 64}}
        )
        # 2. A version signed by a key the workers do not trust.
        foreign_pem, _ = generate_key()
        foreign_key = serialization.load_pem_private_key(foreign_pem, password=None)
        foreign = real.model_copy(
            update={
                "model": "fraud-foreign",
                "key_id": "someone-else",
                "signature": sign(foreign_key, signed_payload("fraud-foreign", "1", real.files)),
            }
        )
        for dv in (edited, foreign):
            dv.config.name = dv.model
            await models.put(subjects.model_key(dv.model, "1"), dv.model_dump_json().encode())
            route = Route(model=dv.model, stable="1", versions=["1"], aliases={"stable": "1"})
            await routes.put(subjects.model_key(dv.model), route.model_dump_json().encode())
    finally:
        await nc.close()
    port = stack.workers[0].ports["metrics"]
    reason = await _worker_state(port, "fraud-edit", "1", "does not match", 20)
    assert "tampered" in reason
    await _worker_state(port, "fraud-foreign", "1", "not trusted", 20)
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        assert not client.is_model_ready("fraud-edit")
        assert not client.is_model_ready("fraud-foreign")
    finally:
        client.close()
    # What was already serving is untouched.
    assert _serves(stack, "fraud").shape == (1, 2)


async def test_flipped_byte_in_the_store_is_refused_by_a_fresh_worker(stack) -> None:
    stored = stack.base / "store/models/fraud/1/model.onnx"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    fresh = stack.start_worker("worker-fresh")
    try:
        reason = await _worker_state(fresh.ports["metrics"], "fraud", "1", "failed", 30)
        assert "SHA-256" in reason or "sha256" in reason.lower() or "digest" in reason.lower()
        # The workers that loaded the good file before keep serving it.
        assert _serves(stack, "fraud").shape == (1, 2)
    finally:
        fresh.terminate()
        fresh.cleanup()
