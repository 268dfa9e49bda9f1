"""PyTorch programs served by the whole stack (issue 27, item 1).

The fraud MLP is built by ``.venvs/torch`` (examples/torch-mlp/build.py) as a
TorchScript program (``model.pt``, answering a dict) and a torch.export
program (``model.pt2``, answering a tuple), pushed (signed), and served by a
worker started with ``.venvs/torch/bin/python`` in pool ``torch``. Answers
over gRPC and HTTP are compared with torch's own output for the same rows
(the program run directly by ``.venvs/torch``), concurrent requests included,
which the worker's micro-batcher runs together (its batch-size histogram
says so).

The stack's other worker runs in the workspace's environment, without torch:
a ``.pt`` version placed on its pool is refused (FAILED_PRECONDITION naming
the version and scripts/bootstrap-torch.sh) while it keeps answering the ONNX
model. A ``.pt2`` pushed without config.json gets its config from the
program's signature (the registry reads it without torch).

``inferbus models profile`` of a PyTorch version runs torch's profiler with
the CLI of .venvs/torch, and is refused, saying so, by a CLI without torch.

Skips only when .venvs/torch is missing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferbus_cli.__main__ import main as cli
from inferbus_testing.examples import infer_concurrently, make_fraud_model
from inferbus_testing.stack import LocalStack
from inferbus_testing.torchmodels import (
    TORCH_MISSING,
    TORCH_PYTHON,
    build_torch_mlp,
    start_torch_worker,
    torch_reference,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not TORCH_PYTHON.exists(), reason=TORCH_MISSING),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    base = tmp_path_factory.mktemp("torch")
    # No fast lane: lone requests would skip the batcher, and the batching check
    # wants every request to reach the worker through it (as tests/e2e/test_e2e_batching).
    with LocalStack(base, workers=1, env={"INFERBUS_GATEWAY_FAST_LANE": "false"}) as st:
        fraud = base / "fraud"
        make_fraud_model(fraud)
        st.push(fraud, "fraud")
        start_torch_worker(st, pool="torch")
        st.wait_model_ready("fraud")
        yield st


def _version(out: Path, fmt: str, *extra: str, **config: Any) -> Path:
    """The fraud MLP as a PyTorch version directory, with `config` changed."""
    build_torch_mlp(out, fmt, *extra)
    path = out / "config.json"
    if path.exists():
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def _grpc(stack: LocalStack, model: str, x: np.ndarray, outputs: list[str]) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = client.infer(model, [inp], client_timeout=60)
        return {o: res.as_numpy(o) for o in outputs}
    finally:
        client.close()


def _http(stack: LocalStack, model: str, x: np.ndarray, outputs: list[str]) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(stack.http_url, network_timeout=60)
    try:
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        res = client.infer(model, [inp])
        return {o: res.as_numpy(o) for o in outputs}
    finally:
        client.close()


def _histogram(stack: LocalStack, metric: str, model: str) -> float:
    worker = stack.procs["torch-worker"]
    return sum(
        v
        for k, v in stack.metrics(worker).items()
        if k.startswith(metric) and f"model={model}," in k
    )


@pytest.mark.parametrize("fmt", ["pt", "pt2"])
def test_programs_answer_like_torch_over_grpc_and_http_in_batches(
    stack: LocalStack, tmp_path: Path, fmt: str
) -> None:
    model = f"mlp-{fmt}"
    version = _version(tmp_path / model, fmt, "--logits", name=model, pool="torch")
    stack.push(version, model)
    stack.wait_model_ready(model, timeout=90)
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        triton = client.get_model_config(model, as_json=True)["config"]
    finally:
        client.close()
    assert (triton["platform"], triton["backend"]) == ("pytorch_libtorch", "pytorch")

    x = np.random.default_rng(7).standard_normal((48, 64)).astype(np.float32)
    ref = torch_reference(version / f"model.{fmt}", x, tmp_path)
    # TorchScript answers a dict (by name), torch.export a tuple (in config order).
    want = {
        "probabilities": ref["probabilities" if fmt == "pt" else "0"],
        "logits": ref["logits" if fmt == "pt" else "1"],
    }
    outputs = ["probabilities", "logits"]
    for answer in (_grpc(stack, model, x[:16], outputs), _http(stack, model, x[:16], outputs)):
        for name in outputs:
            np.testing.assert_allclose(answer[name], want[name][:16], rtol=1e-5, atol=1e-6)

    # 32 concurrent one-row requests: the worker batches them (fewer executions).
    runs_before = _histogram(stack, "inferbus_worker_batch_size_count", model)
    rows_before = _histogram(stack, "inferbus_worker_batch_size_sum", model)
    got = asyncio.run(
        infer_concurrently(stack.grpc_url, model, [x[16 + i : 17 + i] for i in range(32)])
    )
    for i in range(32):
        np.testing.assert_allclose(
            got[i], want["probabilities"][16 + i : 17 + i], rtol=1e-5, atol=1e-6
        )
    runs = _histogram(stack, "inferbus_worker_batch_size_count", model) - runs_before
    rows = _histogram(stack, "inferbus_worker_batch_size_sum", model) - rows_before
    assert rows == 32
    assert runs < 32, f"32 concurrent requests ran in {runs} executions: no batching"


def test_worker_without_torch_refuses_pt_and_keeps_serving(
    stack: LocalStack, tmp_path: Path
) -> None:
    # Placed on the default pool: only the worker of the workspace's .venv (no torch).
    version = _version(tmp_path / "pt-here", "pt", name="pt-no-torch")
    stack.push(version, "pt-no-torch")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    x = np.zeros((1, 64), np.float32)
    inp = grpcclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    refused: InferenceServerException | None = None
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                client.infer("pt-no-torch", [inp], model_version="1", client_timeout=30)
            except InferenceServerException as exc:
                if "UNAVAILABLE" not in str(exc.status()):  # still loading: wait for the verdict
                    refused = exc
                    break
            time.sleep(0.1)
    finally:
        client.close()
    assert refused is not None, "the version was neither refused nor served within 60 s"
    assert refused.status() == "StatusCode.FAILED_PRECONDITION", refused.message()
    text = refused.message()
    assert "pt-no-torch version 1 is a PyTorch program and this worker has no torch" in text
    assert "scripts/bootstrap-torch.sh" in text
    # The same worker still answers the ONNX model.
    answer = _grpc(stack, "fraud", np.ones((2, 64), np.float32), ["probabilities"])
    assert answer["probabilities"].shape == (2, 2)


def test_pt2_without_config_gets_one_from_its_signature(
    stack: LocalStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = build_torch_mlp(tmp_path / "bare", "pt2", "--no-config")
    assert sorted(p.name for p in version.iterdir()) == ["model.pt2"]
    # The bare file, as a person would push it: the CLI prints what was derived.
    push = ["models", "push", str(version / "model.pt2"), "--name", "pt2-bare"]
    assert cli([*push, "--version", "1", "--registry", stack.registry_url]) == 0
    said = capsys.readouterr().err
    assert "the registry derived it from model.pt2" in said, said
    assert cli(["models", "get", "pt2-bare", "--registry", stack.registry_url]) == 0
    doc = json.loads(capsys.readouterr().out)
    config = doc["config"]
    assert (config["platform"], config["file"]) == ("pytorch_libtorch", "model.pt2")
    assert config["engine"]["kind"] == "pytorch" and config["max_batch_size"] == 32
    tensors = [(t["name"], t["datatype"], t["shape"]) for t in config["inputs"] + config["outputs"]]
    assert tensors == [("input", "FP32", [-1, 64]), ("softmax", "FP32", [-1, 2])]
    assert doc["manifest"]["signature"] is None or doc["manifest"]["signature"]["value"]


def test_profile_runs_torch_profiler_where_torch_is(
    stack: LocalStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = _version(tmp_path / "prof", "pt", name="mlp-prof", pool="torch")
    stack.push(version, "mlp-prof")
    registry = ["--registry", stack.registry_url]
    args = ["models", "profile", "mlp-prof", "1", "--batch", "1,32", "--top", "5", *registry]
    # This environment (the workspace's .venv) has no torch: refused, saying where it is.
    assert cli(args) == 1
    said = capsys.readouterr().err
    assert "mlp-prof 1 is a PyTorch program" in said and ".venvs/torch/bin/inferbus" in said
    # models optimize converts ONNX only: refused, naming the engine.
    optimize = ["models", "optimize", "mlp-prof", "1", "--fp16", *registry]
    assert cli(optimize) == 1
    assert "this version's engine is 'pytorch'" in capsys.readouterr().err
    run = subprocess.run(
        [str(TORCH_PYTHON), "-m", "inferbus_cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert sorted(doc["batches"]) == ["1", "32"]
    for ops in doc["batches"].values():
        names = [op["op"] for op in ops]
        assert any(n.startswith("aten::") for n in names), names
        assert all(op["calls"] > 0 and 0 < op["share"] <= 1 for op in ops)
