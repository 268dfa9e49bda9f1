"""A version's ``preprocessor.py`` end to end (issue 27), on a real stack.

The example fraud MLP is pushed with a ``preprocessor.py`` whose
``preprocess`` doubles the input, except for rows marked by their first
value: one loops forever, one calls ``os._exit(3)``, one tries to connect to
the stack's own nats-server. The answers over gRPC and HTTP must equal
onnxruntime run here on the doubled input; the hostile ones must be
answered ``INTERNAL`` naming the version and what happened, before their
deadline, with the worker still up and the same version serving the next
request (its sandboxed process replaced).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_testing.examples import make_fraud_model
from inferbus_testing.stack import LocalStack

pytestmark = pytest.mark.integration

MODEL = "pp"
LOOP, EXIT, NETWORK = 1000.0, 3000.0, 7000.0

PREPROCESSOR = """
import os
import socket

NATS_PORT = {nats_port}


def preprocess(inputs):
    x = inputs["input"]
    marker = float(x[0, 0])
    if marker == {loop}:
        while True:
            pass
    if marker == {exit}:
        os._exit(3)
    if marker == {network}:
        socket.create_connection(("127.0.0.1", NATS_PORT), timeout=1).close()
    x *= 2  # the arrays are the child's own: in-place is fine
    return {{"input": x}}
"""


SHAPES = "pp-shapes"
SHAPES_PREPROCESSOR = """
import numpy as np


def preprocess(inputs):
    raw = inputs["raw"]  # FP64 [rows, 32] from the client
    return {"input": np.concatenate([raw, raw], axis=1).astype(np.float32)}


def postprocess(outputs):
    p = outputs["probabilities"]  # FP32 [rows, 2] from the engine
    return {
        "label": p.argmax(axis=1).astype(np.int64).reshape(-1, 1),
        "score": p.max(axis=1, keepdims=True),
    }
"""


def _shapes_model(fraud: Path, out: Path) -> Path:
    """The fraud MLP behind a client interface of other names, datatypes and shapes."""
    shutil.copytree(fraud, out)
    config = json.loads((out / "config.json").read_text())
    engine_inputs, engine_outputs = config["inputs"], config["outputs"]
    config.update(
        name=SHAPES,
        inputs=[{"name": "raw", "datatype": "FP64", "shape": [-1, 32]}],
        outputs=[
            {"name": "label", "datatype": "INT64", "shape": [-1, 1]},
            {"name": "score", "datatype": "FP32", "shape": [-1, 1]},
        ],
        # The engine's side differs: the config names the file that converts.
        processing={
            "python": "preprocessor.py",
            "engine_inputs": engine_inputs,
            "engine_outputs": engine_outputs,
        },
    )
    (out / "config.json").write_text(json.dumps(config))
    (out / "preprocessor.py").write_text(SHAPES_PREPROCESSOR)
    return out


class PreStack(LocalStack):
    model_dir: Path


def _nats_port(st: LocalStack) -> int:
    return int(st.nats_url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreStack]:
    base = tmp_path_factory.mktemp("stack")
    fraud = base / "fraud"
    make_fraud_model(fraud)
    # A wider reply margin than the default 100 ms: the shared test machine runs
    # at a load of several times its cores, and the INTERNAL answer must beat the
    # gateway's own timer at the deadline.
    st = PreStack(base, workers=1, env={"INFERBUS_WORKER_SCRIPT_REPLY_MARGIN_MS": "300"})
    with st:
        model_dir = base / MODEL
        shutil.copytree(fraud, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config["name"] = MODEL
        (model_dir / "config.json").write_text(json.dumps(config))
        (model_dir / "preprocessor.py").write_text(
            PREPROCESSOR.format(nats_port=_nats_port(st), loop=LOOP, exit=EXIT, network=NETWORK)
        )
        st.model_dir = model_dir
        st.push(model_dir, MODEL)
        st.push(_shapes_model(fraud, base / SHAPES), SHAPES)
        st.wait_model_ready(MODEL)
        st.wait_model_ready(SHAPES)
        yield st


@pytest.fixture(scope="module")
def session(stack: PreStack) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )


def _input(x: np.ndarray, module=grpcclient):
    inp = module.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _rows(n: int, marker: float | None = None, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).random((n, 64), dtype=np.float32)
    if marker is not None:
        x[0, 0] = marker
    return x


def _assert_serves(stack: PreStack, session: ort.InferenceSession, seed: int) -> None:
    """The version answers a normal request with the doubled input's result."""
    x = _rows(2, seed=seed)
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        got = client.infer(MODEL, [_input(x)], client_timeout=20).as_numpy("probabilities")
    finally:
        client.close()
    (want,) = session.run(["probabilities"], {"input": 2 * x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_registry_filled_in_python_and_signed_the_file(stack: PreStack) -> None:
    stored = stack.base / "store" / "models" / MODEL / "1"
    config = json.loads((stored / "config.json").read_text())
    assert config["processing"]["python"] == "preprocessor.py"
    manifest = json.loads((stored / "manifest.json").read_text())
    digest = hashlib.sha256((stack.model_dir / "preprocessor.py").read_bytes()).hexdigest()
    assert manifest["files"]["preprocessor.py"]["sha256"] == digest


def test_doubling_changes_answers_over_grpc_and_http(
    stack: PreStack, session: ort.InferenceSession
) -> None:
    x = _rows(3, seed=1)
    (doubled,) = session.run(["probabilities"], {"input": 2 * x})
    (plain,) = session.run(["probabilities"], {"input": x})
    assert not np.allclose(doubled, plain, atol=1e-4)  # the doubling is visible

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        result = client.infer(MODEL, [_input(x)])
    finally:
        client.close()
    np.testing.assert_allclose(result.as_numpy("probabilities"), doubled, rtol=1e-5, atol=1e-6)
    params = result.get_response().parameters
    assert params["inferbus_pre_us"].int64_param > 0

    body = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [3, 64], "data": x.ravel().tolist()}
        ]
    }
    resp = httpx.post(f"http://{stack.http_url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    out = {o["name"]: o for o in resp.json()["outputs"]}["probabilities"]
    got = np.asarray(out["data"], np.float32).reshape(out["shape"])
    np.testing.assert_allclose(got, doubled, rtol=1e-5, atol=1e-6)
    assert "pre;dur=" in resp.headers["Server-Timing"]


def test_pre_and_post_change_names_datatypes_and_shapes(
    stack: PreStack, session: ort.InferenceSession
) -> None:
    raw = np.random.default_rng(5).random((4, 32))  # FP64
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        meta = client.get_model_metadata(SHAPES)
        inp = grpcclient.InferInput("raw", [4, 32], "FP64")
        inp.set_data_from_numpy(raw)
        result = client.infer(SHAPES, [inp])
    finally:
        client.close()
    # Clients see the client side; the engine's tensors stay inside.
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("raw", "FP64", [-1, 32])]
    assert [(t.name, t.datatype) for t in meta.outputs] == [("label", "INT64"), ("score", "FP32")]
    engine_in = np.concatenate([raw, raw], axis=1).astype(np.float32)
    (probs,) = session.run(["probabilities"], {"input": engine_in})
    np.testing.assert_array_equal(result.as_numpy("label"), probs.argmax(axis=1).reshape(-1, 1))
    np.testing.assert_allclose(
        result.as_numpy("score"), probs.max(axis=1, keepdims=True), rtol=1e-6
    )
    params = result.get_response().parameters
    assert params["inferbus_pre_us"].int64_param > 0
    assert params["inferbus_post_us"].int64_param > 0


async def test_infinite_loop_is_cut_at_the_deadline(
    stack: PreStack, session: ort.InferenceSession
) -> None:
    client = grpcaio.InferenceServerClient(stack.grpc_url)

    async def timed(seed: int, timeout_s: float) -> tuple[object, float]:
        t0 = time.monotonic()
        try:
            outcome: object = await asyncio.wait_for(
                client.infer(
                    MODEL, [_input(_rows(1, LOOP, seed=seed), grpcaio)], client_timeout=timeout_s
                ),
                timeout=timeout_s + 5,  # a hung request fails the test here
            )
        except InferenceServerException as exc:
            outcome = exc
        return outcome, time.monotonic() - t0

    try:
        # Three at once on one execution slot: the first batch is cut at its
        # deadline; the others are cut too, or expire in the queue behind it
        # (DEADLINE_EXCEEDED). None hangs: each is answered by its deadline.
        burst = await asyncio.gather(*(timed(i, 3.0) for i in range(3)))
        alone, alone_s = await timed(7, 2.0)
    finally:
        await client.close()
    statuses = []
    for outcome, seconds in burst:
        assert isinstance(outcome, InferenceServerException), outcome
        statuses.append(outcome.status())
        assert seconds < 3.0 + 0.5, (outcome, seconds)
        if outcome.status() == "StatusCode.INTERNAL":
            assert f"{MODEL}/1" in outcome.message() and "timed out" in outcome.message()
        else:
            assert outcome.status() == "StatusCode.DEADLINE_EXCEEDED", outcome
    assert "StatusCode.INTERNAL" in statuses
    # Alone, with the pool's process replaced: cut at its own 2 s deadline.
    assert isinstance(alone, InferenceServerException), alone
    assert alone.status() == "StatusCode.INTERNAL", alone
    message = alone.message()
    assert f"{MODEL}/1" in message and "timed out after" in message, message
    assert "killed and replaced" in message
    assert 1.5 < alone_s < 2.0 + 0.5, alone_s
    assert stack.procs["worker0"].running
    _assert_serves(stack, session, seed=11)


def test_os_exit_fails_the_batch_and_the_worker_serves_on(
    stack: PreStack, session: ort.InferenceSession
) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer(MODEL, [_input(_rows(2, EXIT))], client_timeout=20)
    finally:
        client.close()
    assert err.value.status() == "StatusCode.INTERNAL"
    message = err.value.message()
    assert f"{MODEL}/1" in message and "exited with code 3" in message, message
    assert stack.procs["worker0"].running
    _assert_serves(stack, session, seed=12)


def test_network_is_unreachable_inside_the_sandbox(
    stack: PreStack, session: ort.InferenceSession
) -> None:
    # Outside the sandbox the same address answers: the isolation is the reason.
    socket.create_connection(("127.0.0.1", _nats_port(stack)), timeout=2).close()
    worker = stack.metrics(stack.procs["worker0"])
    isolated = worker.get(
        f"inferbus_worker_script_sandbox{{model={MODEL},network=isolated,version=1}}"
    )
    if not isolated:
        pytest.skip("no network namespace could be made here (see docs/security.md)")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer(MODEL, [_input(_rows(1, NETWORK))], client_timeout=20)
    finally:
        client.close()
    assert err.value.status() == "StatusCode.INTERNAL"
    message = err.value.message()
    assert f"{MODEL}/1" in message and "Network is unreachable" in message, message
    _assert_serves(stack, session, seed=14)


def test_failures_are_counted_by_reason(stack: PreStack) -> None:
    worker = stack.metrics(stack.procs["worker0"])
    name = "inferbus_worker_script_failures_total"

    def count(reason: str) -> float:
        return worker.get(f"{name}{{model={MODEL},reason={reason},stage=pre,version=1}}", 0.0)

    assert count("timeout") >= 2  # the burst's first batch and the one alone
    assert count("crash") >= 1
