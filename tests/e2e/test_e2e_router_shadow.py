"""Shadow traffic and sticky routing through the whole stack (real processes).

Three versions of a tiny classifier ``shadowm`` (input FP32 [-1, 4] →
probabilities FP32 [-1, 2]):

* ``1`` (stable): logits ``[x0, x1]``;
* ``2``: logits ``[x0, x1 + 10·x2]`` — it disagrees with ``1`` exactly on the
  rows with ``x2 = 1`` (inputs are built with ``x0 = 1, x1 = 0``);
* ``3``: ``1`` plus a ``Gather`` indexed by ``x3``; warm-up (zeros) passes but
  ``x3 = 5`` makes onnxruntime fail, so every such request errors (the worker
  answers INVALID_ARGUMENT: the engine rejected the inputs).

The route is written straight into the routes KV bucket, as the registry's
SetTraffic would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from inferbus_common.catalog import Route, ensure_kv
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.subjects import Subjects
from inferbus_testing.stack import LocalStack

MODEL = "shadowm"
STACK_ENV = {
    "INFERBUS_ROUTER_SHADOW_TIMEOUT_S": "3",
    "INFERBUS_ROUTER_HEALTH_INTERVAL_S": "0.2",
    "INFERBUS_ROUTER_HEALTH_MIN_SAMPLES": "10",
}


def _classifier(shadow_weight: float, failing: bool) -> onnx.ModelProto:
    w = np.zeros((4, 2), np.float32)
    w[0, 0] = 1.0
    w[1, 1] = 1.0
    w[2, 1] = shadow_weight
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(2, np.float32), "b")]
    nodes = [helper.make_node("Gemm", ["input", "w", "b"], ["logits"])]
    last = "logits"
    if failing:
        inits += [
            numpy_helper.from_array(np.zeros((2, 2), np.float32), "table"),
            numpy_helper.from_array(np.array([3], np.int64), "c3"),
            numpy_helper.from_array(np.array([4], np.int64), "c4"),
            numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        ]
        nodes += [
            helper.make_node("Slice", ["input", "c3", "c4", "ax1"], ["x3"]),
            helper.make_node("Squeeze", ["x3", "ax1"], ["x3s"]),
            helper.make_node("Cast", ["x3s"], ["idx"], to=TensorProto.INT64),
            helper.make_node("Gather", ["table", "idx"], ["bump"], axis=0),
            helper.make_node("Add", ["logits", "bump"], ["logits2"]),
        ]
        last = "logits2"
    nodes.append(helper.make_node("Softmax", [last], ["probabilities"], axis=-1))
    graph = helper.make_graph(
        nodes,
        MODEL,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 2])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _write(out: Path, model: onnx.ModelProto) -> Path:
    out.mkdir(parents=True)
    onnx.save_model(model, str(out / "model.onnx"))
    config = ModelConfig.model_validate(
        {
            "name": MODEL,
            "platform": "onnxruntime_onnx",
            "file": "model.onnx",
            "max_batch_size": 32,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}],
            "batching": {"max_queue_delay_us": 500},
        }
    )
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One worker, three versions of ``shadowm`` (1 stable; 2 and 3 pushed without alias)."""
    base = tmp_path_factory.mktemp("shadow-stack")
    dirs = {
        "1": _write(base / "v1", _classifier(0.0, failing=False)),
        "2": _write(base / "v2", _classifier(10.0, failing=False)),
        "3": _write(base / "v3", _classifier(0.0, failing=True)),
    }
    with LocalStack(base, workers=1, env=STACK_ENV) as st:
        st.push(dirs["1"], MODEL, "1")

        async def push_more() -> None:
            from inferbus_client.registry import RegistryClient

            async with RegistryClient(st.registry_url) as client:
                await client.push(dirs["2"], MODEL, "2")
                await client.push(dirs["3"], MODEL, "3")

        asyncio.run(push_more())
        st.wait_model_ready(MODEL)
        yield st


def set_route(stack: LocalStack, **changes: object) -> Route:
    """Read-modify-write the model's route in KV (revision + 1)."""

    async def _set() -> Route:
        assert stack.nats is not None
        nc = await nats.connect(stack.nats.url)
        try:
            kv = await ensure_kv(nc.jetstream(), Subjects().routes_bucket)
            entry = await kv.get(Subjects.model_key(MODEL))
            route = Route.model_validate_json(entry.value)
            route = route.model_copy(
                update={**changes, "revision": route.revision + 1, "updated_by": "test"}
            )
            await kv.put(Subjects.model_key(MODEL), route.model_dump_json().encode())
            return route
        finally:
            await nc.close()

    return asyncio.run(_set())


def wait_version_ready(stack: LocalStack, version: str, timeout: float = 60.0) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    deadline = time.monotonic() + timeout
    try:
        while not client.is_model_ready(MODEL, version):
            assert time.monotonic() < deadline, f"version {version} not ready"
            time.sleep(0.05)
    finally:
        client.close()


def infer(client: grpcclient.InferenceServerClient, row: list[float], **kw) -> tuple[str, int]:
    """One request of one row; returns (answering version, argmax)."""
    inp = grpcclient.InferInput("input", [1, 4], "FP32")
    inp.set_data_from_numpy(np.array([row], np.float32))
    result = client.infer(MODEL, [inp], **kw)
    version = result.get_response().model_version
    return version, int(np.argmax(result.as_numpy("probabilities")[0]))


def router_sample(stack: LocalStack, name: str, **labels: str) -> float:
    key = f"{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}"
    return stack.metrics(stack.router).get(key, 0.0)


def wait_metric(stack: LocalStack, name: str, value: float, timeout: float = 20, **labels):
    deadline = time.monotonic() + timeout
    while router_sample(stack, name, **labels) < value:
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {value}"
        time.sleep(0.1)


def test_worker_loads_the_shadow_version_and_agreement_is_measured(stack: LocalStack) -> None:
    set_route(stack, shadow="2", shadow_rate=1.0)
    wait_version_ready(stack, "2")
    n, flipped = 200, 0
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        for i in range(n):
            x2 = 1.0 if i % 10 < 3 else 0.0  # version 2 disagrees on exactly these 30 %
            flipped += int(x2)
            version, label = infer(client, [1.0, 0.0, x2, 0.0])
            # The client always gets the primary's answer, never the shadow's.
            assert (version, label) == ("1", 0)
    finally:
        client.close()
    labels = {"model": MODEL, "primary": "1", "shadow": "2"}
    wait_metric(stack, "inferbus_shadow_requests_total", n, **labels, outcome="compared")
    agree = router_sample(stack, "inferbus_shadow_rows_total", **labels, result="agree")
    disagree = router_sample(stack, "inferbus_shadow_rows_total", **labels, result="disagree")
    ratio = router_sample(stack, "inferbus_shadow_agreement_ratio", **labels)
    print(f"shadow agreement {ratio:.3f} (expected {1 - flipped / n:.3f}), {agree=}, {disagree=}")
    assert (agree, disagree) == (n - flipped, flipped)
    assert ratio == pytest.approx(1 - flipped / n)
    assert router_sample(stack, "inferbus_shadow_abs_diff_count", **labels) == n


def test_failing_shadow_causes_no_client_errors(stack: LocalStack) -> None:
    set_route(stack, shadow="3", shadow_rate=1.0)
    wait_version_ready(stack, "3")
    n = 100
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        # x3 = 5 breaks version 3's Gather; version 1 ignores x3.
        answers = [infer(client, [1.0, 0.0, 0.0, 5.0]) for _ in range(n)]
    finally:
        client.close()
    assert answers == [("1", 0)] * n
    labels = {"model": MODEL, "primary": "1", "shadow": "3"}
    wait_metric(stack, "inferbus_shadow_requests_total", n, **labels, outcome="shadow_error")
    assert router_sample(stack, "inferbus_shadow_requests_total", **labels, outcome="compared") == 0


def test_sticky_header_keeps_each_user_on_one_version(stack: LocalStack) -> None:
    route = set_route(
        stack, shadow="", shadow_rate=0.0, canary="2", canary_weight=50.0, sticky="header:X-User"
    )
    wait_metric(stack, "inferbus_router_route_revision", route.revision, model=MODEL)
    # The gateway follows the route live too; until it copies the header the
    # router falls back to the weighted choice, so retry the round briefly.
    deadline = time.monotonic() + 10
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        seen: dict[str, set[str]] = {}
        while True:
            seen.clear()
            for u in range(30):
                for _ in range(3):
                    version, _ = infer(client, [1.0, 0.0, 0.0, 0.0], headers={"x-user": f"u{u}"})
                    seen.setdefault(f"u{u}", set()).add(version)
            if all(len(v) == 1 for v in seen.values()) or time.monotonic() > deadline:
                break
    finally:
        client.close()
    assert all(len(v) == 1 for v in seen.values()), seen
    assert {v for vs in seen.values() for v in vs} == {"1", "2"}


def test_failing_canary_weight_is_cut_from_the_gateways_audit_records(stack: LocalStack) -> None:
    route = set_route(stack, canary="3", canary_weight=50.0, sticky="")
    wait_metric(stack, "inferbus_router_route_revision", route.revision, model=MODEL)
    # The first evaluation after the change exports the full configured weight.
    wait_metric(stack, "inferbus_router_effective_weight", 50.0, model=MODEL, version="3")
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    deadline = time.monotonic() + 30
    try:
        while (
            router_sample(stack, "inferbus_router_effective_weight", model=MODEL, version="3") >= 50
        ):
            assert time.monotonic() < deadline, "the failing canary kept its weight"
            for _ in range(20):
                # Version 3 fails on x3 = 5 (the client sees those errors: it is
                # the canary's real answer); stable answers the rest.
                try:
                    infer(client, [1.0, 0.0, 0.0, 5.0])
                except InferenceServerException:
                    pass
    finally:
        client.close()
    weight = router_sample(stack, "inferbus_router_effective_weight", model=MODEL, version="3")
    print(f"effective weight of the failing canary: {weight} (configured 50)")
    assert 5.0 <= weight < 50.0
    assert router_sample(stack, "inferbus_router_route_revision", model=MODEL) == route.revision
