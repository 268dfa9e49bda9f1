"""An OpenVINO-EP version serves (issue 27).

The fraud example, with ``engine.providers: ["openvino"]`` and ``pool:
"openvino"``, is pushed and served by a worker started with
``.venvs/openvino/bin/python`` (onnxruntime-openvino, scripts/bootstrap-openvino.sh)
in pool ``openvino``. Its answers over gRPC and HTTP are compared with
onnxruntime's CPU provider run here on the same rows (the A/B bench's error
was ~1e-7; the tolerance is 1e-4), and 32 concurrent one-row requests are
answered the same and batched by the worker (its batch-size histogram).

The stack's other worker runs the workspace's onnxruntime, without the EP; the
refusal of such a version there is tests/e2e/test_e2e_optimize.py's.

Skips, saying why, when .venvs/openvino is missing or its onnxruntime has no
OpenVINOExecutionProvider.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from inferbus_testing.examples import infer_concurrently, make_fraud_model
from inferbus_testing.openvino import openvino_missing, start_openvino_worker
from inferbus_testing.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "fraud-ov"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    reason = openvino_missing()
    if reason is not None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("openvino")
    fraud = base / "fraud"
    make_fraud_model(fraud)
    ov = base / MODEL
    shutil.copytree(fraud, ov)
    doc = json.loads((ov / "config.json").read_text())
    doc.update(name=MODEL, pool="openvino", engine={"providers": ["openvino"]})
    (ov / "config.json").write_text(json.dumps(doc))
    # No fast lane: every request reaches the worker through the batcher.
    with LocalStack(base, workers=1, env={"INFERBUS_GATEWAY_FAST_LANE": "false"}) as st:
        st.push(fraud, "fraud")
        st.push(ov, MODEL)
        start_openvino_worker(st, pool="openvino")
        st.wait_model_ready(MODEL, timeout=90)
        yield st


def _reference(stack: LocalStack, x: np.ndarray) -> np.ndarray:
    """onnxruntime's CPU provider (the workspace's build) on the same model."""
    model = stack.base / MODEL / "model.onnx"
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(["probabilities"], {"input": x})[0])


def _histogram(stack: LocalStack, metric: str) -> float:
    worker = stack.procs["openvino-worker"]
    return sum(
        v
        for k, v in stack.metrics(worker).items()
        if k.startswith(metric) and f"model={MODEL}," in k
    )


def test_openvino_version_answers_like_onnxruntime_cpu_in_batches(stack: LocalStack) -> None:
    x = np.random.default_rng(11).standard_normal((48, 64)).astype(np.float32)
    want = _reference(stack, x)

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        inp = grpcclient.InferInput("input", [16, 64], "FP32")
        inp.set_data_from_numpy(x[:16])
        by_grpc = client.infer(MODEL, [inp], client_timeout=60).as_numpy("probabilities")
    finally:
        client.close()
    http = httpclient.InferenceServerClient(stack.http_url, network_timeout=60)
    try:
        inp_h = httpclient.InferInput("input", [16, 64], "FP32")
        inp_h.set_data_from_numpy(x[:16], binary_data=False)
        by_http = http.infer(MODEL, [inp_h]).as_numpy("probabilities")
    finally:
        http.close()
    for got in (by_grpc, by_http):
        assert got is not None
        np.testing.assert_allclose(got, want[:16], rtol=1e-4, atol=1e-4)

    # The session computes on the OpenVINO EP first (the worker logs its providers;
    # a session fallen back to the CPU alone would have been refused).
    log = stack.procs["openvino-worker"].log_path.read_text()
    assert "engine: onnxruntime[OpenVINOExecutionProvider" in log

    runs_before = _histogram(stack, "inferbus_worker_batch_size_count")
    rows_before = _histogram(stack, "inferbus_worker_batch_size_sum")
    got = asyncio.run(
        infer_concurrently(stack.grpc_url, MODEL, [x[16 + i : 17 + i] for i in range(32)])
    )
    for i in range(32):
        np.testing.assert_allclose(got[i], want[16 + i : 17 + i], rtol=1e-4, atol=1e-4)
    runs = _histogram(stack, "inferbus_worker_batch_size_count") - runs_before
    rows = _histogram(stack, "inferbus_worker_batch_size_sum") - rows_before
    assert rows == 32
    assert runs < 32, f"32 concurrent requests ran in {runs} executions: no batching"
