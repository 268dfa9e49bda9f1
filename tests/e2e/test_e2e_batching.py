"""Batching across the whole path: batches really form under concurrency."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc.aio as grpcaio

pytestmark = pytest.mark.integration

# The batcher's batching is what is counted here: without the fast lane, whose lone
# requests (the first of a burst, sent before others are in flight) skip the batcher
# (tests/e2e/test_e2e_fast_lane.py).
STACK_ENV = {"INFERBUS_GATEWAY_FAST_LANE": "false"}


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


async def test_64_concurrent_requests_form_batches(stack) -> None:
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    before = stack.metrics(stack.batcher)
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    xs = [np.random.default_rng(i).standard_normal((1, 64)).astype(np.float32) for i in range(64)]

    async def one(x: np.ndarray) -> np.ndarray:
        inp = grpcaio.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        return (await client.infer("fraud", [inp])).as_numpy("probabilities")

    try:
        results = await asyncio.gather(*(one(x) for x in xs))
    finally:
        await client.close()
    for x, got in zip(xs, results, strict=True):
        np.testing.assert_allclose(got, session.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6)

    after = stack.metrics(stack.batcher)
    requests = _sum(after, "inferbus_batcher_batch_requests_sum") - _sum(
        before, "inferbus_batcher_batch_requests_sum"
    )
    batches = _sum(after, "inferbus_batcher_batch_requests_count") - _sum(
        before, "inferbus_batcher_batch_requests_count"
    )
    singles = _sum(after, "inferbus_batcher_batch_requests_bucket{le=1.0") - _sum(
        before, "inferbus_batcher_batch_requests_bucket{le=1.0"
    )
    assert requests == 64
    assert batches < 64, f"64 requests went out in {batches} batches: no batching happened"
    assert singles < batches, "every batch held a single request"
