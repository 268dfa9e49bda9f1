"""issue 27 through the whole stack: `models optimize --fp16 / --int8` versions serve
over gRPC when pinned (aliases untouched); `models profile` prints operators; an
`openvino` version is refused with FAILED_PRECONDITION where the EP is absent."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from inferbus_cli.__main__ import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _infer(client: grpcclient.InferenceServerClient, model: str, version: str, x: np.ndarray):
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    deadline = time.monotonic() + 60
    while True:
        try:
            res = client.infer(model, [inp], model_version=version, client_timeout=30)
            return res.as_numpy("probabilities")
        except InferenceServerException as exc:
            if "UNAVAILABLE" not in str(exc.status()) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_optimized_versions_serve_and_profile_prints(stack, capsys) -> None:
    reg = ["--registry", stack.registry_url]
    for flag, to in (("--fp16", "2"), ("--int8", "3")):
        assert main(["models", "optimize", "fraud", "1", flag, "--to", to, *reg]) == 0
        record = json.loads(capsys.readouterr().out.split("\n", 2)[2])
        assert record["error"]["max_abs_diff"] < 0.2
        assert record["speed_cpu_p50_us"]["optimized"]["batch1_p50_us"] > 0
    assert main(["models", "get", "fraud", "--version", "stable", *reg]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == "1"  # aliases not moved
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    want = _infer(client, "fraud", "1", x)
    for version in ("2", "3"):
        got = _infer(client, "fraud", version, x)
        assert got.shape == want.shape and np.abs(got - want).max() < 0.2
    assert main(["models", "profile", "fraud", "1", "--batch", "1,8,32", *reg]) == 0
    out = capsys.readouterr().out
    assert "batch 32:" in out and "us/run" in out


def test_openvino_version_is_refused_with_the_reason(stack, tmp_path) -> None:
    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-openvino is installed: the version would load")
    out = tmp_path / "ov"
    shutil.copytree(stack.model_dir, out)
    doc = json.loads((out / "config.json").read_text())
    doc.update(name="ov", engine={"providers": ["openvino"]})
    (out / "config.json").write_text(json.dumps(doc))
    stack.push(out, "ov")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    with pytest.raises(InferenceServerException) as refused:
        _infer(client, "ov", "1", np.zeros((1, 64), np.float32))
    assert refused.value.status() == "StatusCode.FAILED_PRECONDITION", refused.value.message()
    assert "['openvino']" in refused.value.message()
