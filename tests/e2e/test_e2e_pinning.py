"""Version pinning through the whole stack (real processes), over gRPC and HTTP.

Model ``pinm`` has two semantic versions whose answers and outputs differ, so
an answer shows which version computed it (its value and ``model_version``)
and a wrong choice of config shows as a refused request. Both take input FP32
[-1, 4]:

* ``1.0.0`` (stable): ``y`` = row sum, and ``w`` = 2 × row sum (stable only);
* ``1.1.0`` (canary): ``y`` = row sum + 1000, and ``z`` = 3 × row sum (canary only).

With the route ``stable=1.0.0, canary=1.1.0`` at weight 0, a request pinned to
``canary`` or ``1.1.0`` is answered by 1.1.0, a request pinned to ``stable``
or to nothing by 1.0.0, and a pin naming nothing is NOT_FOUND naming the model
and the pin. A request for ``z`` pinned to the canary passes only because the
gateway validates against the version that runs (`inferbus_common.resolver`,
the router's rule); at weight 100 a request for ``w``, which the canary's
config refuses, still runs on stable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from inferbus_common.modelconfig import ModelConfig
from inferbus_testing.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "pinm"
OFFSET = {"1.0.0": 0.0, "1.1.0": 1000.0}
EXTRA = {"1.0.0": ("w", 2.0), "1.1.0": ("z", 3.0)}
"""Each version's own second output and its factor on the row sum."""
ROWS = np.array([[1.0] * 4, [2.0] * 4], np.float32)
SUMS = [4.0, 8.0]


def _write(out: Path, version: str) -> Path:
    """A version of ``pinm``: y = x · ones + offset, and its own second output."""
    extra, factor = EXTRA[version]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "ones"], ["s"]),
            helper.make_node("Add", ["s", "offset"], ["y"]),
            helper.make_node("Mul", ["s", "factor"], [extra]),
        ],
        MODEL,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info(extra, TensorProto.FLOAT, ["batch", 1]),
        ],
        initializer=[
            numpy_helper.from_array(np.ones((4, 1), np.float32), "ones"),
            numpy_helper.from_array(np.array([OFFSET[version]], np.float32), "offset"),
            numpy_helper.from_array(np.array([factor], np.float32), "factor"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    out.mkdir(parents=True)
    onnx.save_model(model, str(out / "model.onnx"))
    config = ModelConfig.model_validate(
        {
            "name": MODEL,
            "platform": "onnxruntime_onnx",
            "file": "model.onnx",
            "max_batch_size": 8,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "y", "datatype": "FP32", "shape": [-1, 1]},
                {"name": extra, "datatype": "FP32", "shape": [-1, 1]},
            ],
        }
    )
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    return out


def _wait_ready(stack: LocalStack, version: str, timeout: float = 60.0) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        for _ in range(int(timeout / 0.05)):
            if client.is_model_ready(MODEL, version):
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError(f"{MODEL} {version} not ready after {timeout}s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One worker; ``pinm`` 1.0.0 stable and 1.1.0 its canary at weight 0."""
    base = tmp_path_factory.mktemp("pin-stack")
    dirs = {v: _write(base / v, v) for v in OFFSET}
    with LocalStack(base, workers=1) as st:
        st.push(dirs["1.0.0"], MODEL, "1.0.0")

        async def canary() -> None:
            from inferbus_client.registry import RegistryClient

            async with RegistryClient(st.registry_url) as client:
                await client.push(dirs["1.1.0"], MODEL, "1.1.0", aliases=[])
                await client.set_traffic(MODEL, canary="1.1.0", canary_weight=0.0, updated_by="e2e")

        asyncio.run(canary())
        _wait_ready(st, "1.0.0")
        _wait_ready(st, "1.1.0")
        yield st


def _expected(version: str, output: str = "y") -> list[float]:
    if output == "y":
        return [x + OFFSET[version] for x in SUMS]
    name, factor = EXTRA[version]
    assert name == output
    return [x * factor for x in SUMS]


def _grpc(stack: LocalStack, pin: str, output: str = "y") -> tuple[str, list[float]]:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        inp = grpcclient.InferInput("input", list(ROWS.shape), "FP32")
        inp.set_data_from_numpy(ROWS)
        wanted = [grpcclient.InferRequestedOutput(output)]
        result = client.infer(MODEL, [inp], model_version=pin, outputs=wanted)
        return result.get_response().model_version, result.as_numpy(output)[:, 0].tolist()
    finally:
        client.close()


def _http(stack: LocalStack, pin: str, output: str = "y") -> httpx.Response:
    path = f"/v2/models/{MODEL}/versions/{pin}/infer" if pin else f"/v2/models/{MODEL}/infer"
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": list(ROWS.shape),
                "datatype": "FP32",
                "data": ROWS.ravel().tolist(),
            }
        ],
        "outputs": [{"name": output}],
    }
    return httpx.post(f"http://{stack.http_url}{path}", json=body, timeout=30.0)


def _http_answer(response: httpx.Response) -> tuple[str, list[float]]:
    assert response.status_code == 200, response.text
    doc = response.json()
    return doc["model_version"], [float(v) for v in doc["outputs"][0]["data"]]


# pin → the version that must answer it.
CASES = [("canary", "1.1.0"), ("1.1.0", "1.1.0"), ("", "1.0.0"), ("stable", "1.0.0")]


@pytest.mark.parametrize(("pin", "version"), CASES)
def test_grpc_pins_answer_from_the_named_version(stack: LocalStack, pin: str, version: str) -> None:
    assert _grpc(stack, pin) == (version, _expected(version))


@pytest.mark.parametrize(("pin", "version"), CASES)
def test_http_pins_answer_from_the_named_version(stack: LocalStack, pin: str, version: str) -> None:
    assert _http_answer(_http(stack, pin)) == (version, _expected(version))


def test_each_request_is_validated_against_the_version_that_runs(stack: LocalStack) -> None:
    # The canary's own output, pinned to the canary: valid there (stable has no z).
    for pin in ("canary", "1.1.0"):
        assert _grpc(stack, pin, "z") == ("1.1.0", _expected("1.1.0", "z"))
        assert _http_answer(_http(stack, pin, "z")) == ("1.1.0", _expected("1.1.0", "z"))
    # ... and refused where stable runs, and stable's own output on the canary.
    for pin, output in (("", "z"), ("stable", "z"), ("canary", "w")):
        with pytest.raises(InferenceServerException) as err:
            _grpc(stack, pin, output)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value.message()
        assert output in err.value.message()
        assert _http(stack, pin, output).status_code == 400


def test_pins_that_name_nothing_are_not_found(stack: LocalStack) -> None:
    with pytest.raises(InferenceServerException) as err:
        _grpc(stack, "2.0.0")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert f"model '{MODEL}' has no version '2.0.0' and no alias '2.0.0'" in err.value.message()
    response = _http(stack, "nightly")
    assert response.status_code == 404, response.text
    assert f"model '{MODEL}' has no version 'nightly' and no alias 'nightly'" in response.text


def test_a_split_sends_the_canary_only_requests_it_can_run(stack: LocalStack) -> None:
    """All unpinned traffic on the canary (weight 100), except requests for
    stable's own output, which the canary's config refuses: they run on stable."""

    async def weight(value: float) -> None:
        from inferbus_client.registry import RegistryClient

        async with RegistryClient(stack.registry_url) as client:
            await client.set_traffic(MODEL, canary_weight=value, updated_by="e2e")

    asyncio.run(weight(100.0))
    try:
        # An answer from 1.1.0 shows the gateway saw the split: while it did
        # not, it pinned unpinned requests to stable's concrete version.
        answers = []
        for _ in range(400):
            answers.append(_grpc(stack, "")[0])
            if answers[-1] == "1.1.0":
                break
            time.sleep(0.05)
        assert answers[-1] == "1.1.0", f"the canary never took traffic: {answers[-3:]}"
        for _ in range(5):
            assert _grpc(stack, "", "w") == ("1.0.0", _expected("1.0.0", "w"))
            assert _http_answer(_http(stack, "", "w")) == ("1.0.0", _expected("1.0.0", "w"))
            assert _grpc(stack, "") == ("1.1.0", _expected("1.1.0"))
    finally:
        asyncio.run(weight(0.0))
