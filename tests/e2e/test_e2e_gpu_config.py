"""GPU configs through the whole stack on a CPU machine (issue 26): a version that
may only run on CUDA is refused by the workers and its requests get
FAILED_PRECONDITION naming the provider (never answers computed on the CPU);
an instance group of 2 serves with two sessions and is reported in Triton's
model config."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _version(stack, tmp_path, name: str, **config: object):
    """The fraud model as model `name`, with `config` changed."""
    out = tmp_path / name
    shutil.copytree(stack.model_dir, out)
    doc = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**doc, "name": name, **config}))
    return out


def _infer(client: grpcclient.InferenceServerClient, model: str, x: np.ndarray, **kw: object):
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], client_timeout=30, **kw)


def test_cuda_only_version_is_refused_with_the_reason(stack, tmp_path) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider: the version would load")
    stack.push(_version(stack, tmp_path, "gpuonly", engine={"providers": ["cuda"]}), "gpuonly")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    x = np.zeros((1, 64), np.float32)
    # The workers refuse it for good: the request gets the reason, not "retry".
    with pytest.raises(InferenceServerException) as refused:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                _infer(client, "gpuonly", x, model_version="1")
            except InferenceServerException as exc:
                # UNAVAILABLE while the workers are still loading it; then the verdict.
                if "UNAVAILABLE" not in str(exc.status()):
                    raise
            time.sleep(0.1)
    assert refused.value.status() == "StatusCode.FAILED_PRECONDITION", refused.value.message()
    assert "execution providers ['cuda']" in refused.value.message()
    config = client.get_model_config("gpuonly", as_json=True)["config"]
    assert config["instance_group"][0]["kind"] == "KIND_GPU"


def test_instance_group_of_two_serves_and_is_reported(stack, tmp_path) -> None:
    stack.push(_version(stack, tmp_path, "grouped", instance_group={"count": 2}), "grouped")
    stack.wait_model_ready("grouped")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    (group,) = client.get_model_config("grouped", as_json=True)["config"]["instance_group"]
    assert (group["kind"], int(group["count"])) == ("KIND_CPU", 2)
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    for seed in range(8):
        x = np.random.default_rng(seed).normal(size=(2, 64)).astype(np.float32)
        got = _infer(client, "grouped", x).as_numpy("probabilities")
        want = session.run(["probabilities"], {"input": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
