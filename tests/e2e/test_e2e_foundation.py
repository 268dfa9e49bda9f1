"""End to end with Triton's own client, unmodified: gRPC and HTTP through
gateway → router → batcher → worker over a real NATS server."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferbus_common import bus
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb
from inferbus_proto.v2 import grpc_predict_v2_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference(stack):
    """onnxruntime run directly on the same file: the ground truth."""
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return lambda x: session.run(["probabilities"], {"input": x})[0]


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 64)).astype(np.float32)


@pytest.mark.parametrize("rows", [1, 8])
def test_grpc_matches_onnxruntime(stack, reference, rows: int) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    x = _rows(rows, seed=rows)
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("fraud", [inp], request_id=f"grpc-{rows}")
    got = result.as_numpy("probabilities")
    assert got.shape == (rows, 2)
    np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)
    response = result.get_response()
    assert response.id == f"grpc-{rows}"
    assert response.model_version == "1"
    assert response.parameters["inferbus_total_us"].int64_param > 0
    client.close()


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("binary", [True, False])
def test_http_matches_onnxruntime(stack, reference, rows: int, binary: bool) -> None:
    client = httpclient.InferenceServerClient(stack.http_url)
    x = _rows(rows, seed=100 + rows)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("probabilities", binary_data=binary)
    result = client.infer("fraud", [inp], outputs=[out])
    np.testing.assert_allclose(result.as_numpy("probabilities"), reference(x), rtol=1e-5, atol=1e-6)
    client.close()


async def test_100_concurrent_requests_each_get_their_own_answer(stack, reference) -> None:
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    xs = [_rows(1, seed=1000 + i) for i in range(100)]

    async def one(i: int) -> np.ndarray:
        inp = grpcaio.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(xs[i])
        result = await client.infer("fraud", [inp], request_id=f"c{i}")
        assert result.get_response().id == f"c{i}"
        return result.as_numpy("probabilities")

    try:
        results = await asyncio.gather(*(one(i) for i in range(100)))
    finally:
        await client.close()
    for x, got in zip(xs, results, strict=True):
        np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)
    # Distinct inputs → distinct answers (nobody got a neighbour's reply).
    assert len({r.tobytes() for r in results}) == 100


def _infer_error(stack, model: str, inputs, **kw) -> InferenceServerException:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, inputs, **kw)
    finally:
        client.close()
    return info.value


def _input(name: str, shape: list[int], datatype: str, data: np.ndarray):
    inp = grpcclient.InferInput(name, shape, datatype)
    inp.set_data_from_numpy(data)
    return inp


def test_unknown_model_is_not_found(stack) -> None:
    err = _infer_error(stack, "no-such-model", [_input("input", [1, 64], "FP32", _rows(1, 0))])
    assert err.status() == "StatusCode.NOT_FOUND"
    assert "no-such-model" in err.message()


@pytest.mark.parametrize(
    ("inp", "needle"),
    [
        (lambda: _input("wrong", [1, 64], "FP32", _rows(1, 0)), "unknown input"),
        (
            lambda: _input("input", [1, 64], "FP64", _rows(1, 0).astype(np.float64)),
            "datatype FP64, expected FP32",
        ),
        (lambda: _input("input", [1, 63], "FP32", _rows(1, 0)[:, :63]), "shape [1, 63]"),
        (lambda: _input("input", [33, 64], "FP32", _rows(33, 0)), "max_batch_size"),
    ],
)
def test_bad_input_is_invalid_argument(stack, inp, needle: str) -> None:
    err = _infer_error(stack, "fraud", [inp()])
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert needle in err.message()


def test_raw_bytes_not_matching_shape_and_missing_input(stack) -> None:
    channel = grpc.insecure_channel(stack.grpc_url)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    req = pb.ModelInferRequest(model_name="fraud")
    req.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    req.raw_input_contents.append(b"\0" * 100)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "100 bytes" in info.value.details() and "256" in info.value.details()

    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb.ModelInferRequest(model_name="fraud"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "missing input" in info.value.details()
    channel.close()


def test_http_errors_have_status_and_message(stack) -> None:
    import httpx

    base = f"http://{stack.http_url}"
    one = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
    r = httpx.post(f"{base}/v2/models/nope/infer", json={"inputs": [one]})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.post(f"{base}/v2/models/fraud/infer", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = httpx.post(
        f"{base}/v2/models/fraud/infer",
        json={"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [1.0]}]},
    )
    assert r.status_code == 400 and "needs 64" in r.json()["error"]


def test_no_request_hangs_past_its_deadline(stack, reference) -> None:
    """Workers frozen (SIGSTOP): the gateway answers DEADLINE_EXCEEDED on time;
    once they resume, the late answer is dropped and service continues."""
    for w in stack.workers:
        w.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        err = _infer_error(
            stack, "fraud", [_input("input", [1, 64], "FP32", _rows(1, 5))], timeout=500_000
        )
        elapsed = time.monotonic() - t0
    finally:
        for w in stack.workers:
            w.send_signal(signal.SIGCONT)
    assert err.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert 0.4 < elapsed < 2.0
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    x = _rows(2, seed=77)
    result = client.infer("fraud", [_input("input", [2, 64], "FP32", x)])
    np.testing.assert_allclose(result.as_numpy("probabilities"), reference(x), rtol=1e-5, atol=1e-6)
    client.close()


def test_bad_requests_leave_the_stack_serving(stack, reference) -> None:
    for _ in range(20):
        _infer_error(stack, "fraud", [_input("wrong", [1, 64], "FP32", _rows(1, 0))])
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    assert client.is_server_ready() and client.is_model_ready("fraud")
    md = client.get_model_metadata("fraud", as_json=True)
    assert md["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": ["-1", "64"]}
    x = _rows(3, seed=3)
    result = client.infer("fraud", [_input("input", [3, 64], "FP32", x)])
    np.testing.assert_allclose(result.as_numpy("probabilities"), reference(x), rtol=1e-5, atol=1e-6)
    client.close()


async def test_every_answered_request_leaves_an_audit_record(stack) -> None:
    """One `AuditRecord` per answer on ``ib.audit.<model>`` (batched, one per
    line): version, digest and stage timings for a success, the status for a refusal."""
    import nats

    from inferbus_common.audit import decode_records
    from inferbus_common.subjects import Subjects

    assert stack.nats is not None
    nc = await nats.connect(stack.nats.url)
    records: asyncio.Queue = asyncio.Queue()

    async def on_record(msg) -> None:
        for record in decode_records(msg.data):
            await records.put(record)

    await nc.subscribe(Subjects().audit_all, cb=on_record)
    await bus.sync(nc)
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    try:
        # A fresh subscription may miss its first message (nats-server 2.15.1):
        # send until one record arrives before the checked requests.
        deadline = time.monotonic() + 10
        while records.empty():
            assert time.monotonic() < deadline, "no audit record arrived"
            await client.infer("fraud", [_input_aio("input", [1, 64], "FP32", _rows(1, 1))])
            await asyncio.sleep(0.05)
        await client.infer(
            "fraud", [_input_aio("input", [2, 64], "FP32", _rows(2, 2))], request_id="audit-ok"
        )
        with pytest.raises(InferenceServerException):
            await client.infer(
                "fraud", [_input_aio("wrong", [1, 64], "FP32", _rows(1, 0))], request_id="audit-bad"
            )
        seen: dict[str, object] = {}
        deadline = time.monotonic() + 10
        while not {"audit-ok", "audit-bad"} <= seen.keys():
            rec = await asyncio.wait_for(records.get(), max(0.1, deadline - time.monotonic()))
            seen[rec.request_id] = rec
    finally:
        await client.close()
        await nc.close()
    ok, bad = seen["audit-ok"], seen["audit-bad"]
    assert (ok.model, ok.version, ok.status, ok.protocol) == ("fraud", "1", "OK", "grpc")
    assert len(ok.digest) == 64 and ok.latency_ms > 0
    assert {"queue", "compute", "gateway"} <= ok.stages_ms.keys()
    assert (bad.model, bad.status, bad.version) == ("fraud", "INVALID_ARGUMENT", "")
    assert ok.gateway and ok.gateway == bad.gateway


def _input_aio(name: str, shape: list[int], datatype: str, data: np.ndarray) -> grpcaio.InferInput:
    inp = grpcaio.InferInput(name, shape, datatype)
    inp.set_data_from_numpy(data)
    return inp
