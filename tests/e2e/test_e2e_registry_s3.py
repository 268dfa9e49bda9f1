"""The registry on real S3 (SeaweedFS) under the whole stack, as real processes.

* round trip: push, list, alias, serve, archive an old version;
* Triton's repository extension through UNMODIFIED tritonclient (gRPC and
  HTTP): index, unload, load, is_model_ready before and after;
* a ``load_policy: lazy`` version: routed but not loaded until its first
  request, which is answered (or told "loading, retry") within its deadline.

One stack (one worker) for the module; tests run in file order and each
leaves ``fraud`` served by a stable version.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferbus_client.registry import RegistryClient
from inferbus_testing.examples import make_fraud_model
from inferbus_testing.servers import S3Server
from inferbus_testing.stack import LocalStack

pytestmark = [pytest.mark.integration]


class Stack(LocalStack):
    """A `LocalStack` that knows its model directory and S3 bucket."""

    model_dir: Path
    bucket: str


@pytest.fixture(scope="module")
def s3_stack(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack with the registry on S3, one worker, a short unload grace."""
    base = tmp_path_factory.mktemp("s3stack")
    bucket = "ib-e2e-" + secrets.token_hex(4)
    env = {
        "INFERBUS_REGISTRY_STORE": "s3",
        "INFERBUS_REGISTRY_S3_ENDPOINT": s3_server.endpoint,
        "INFERBUS_REGISTRY_S3_ACCESS_KEY": s3_server.access_key,
        "INFERBUS_REGISTRY_S3_SECRET_KEY": s3_server.secret_key,
        "INFERBUS_REGISTRY_S3_BUCKET": bucket,
        "INFERBUS_WORKER_UNLOAD_GRACE_S": "0.5",
        "INFERBUS_WORKER_HEARTBEAT_S": "0.5",
    }
    st = Stack(base, workers=1, env=env)
    st.model_dir = make_fraud_model(base / "fraud-model")
    st.bucket = bucket
    with st:
        yield st


def _registry(stack: Stack, coro_fn):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        async with RegistryClient(stack.registry_url) as client:
            return await coro_fn(client)

    return asyncio.run(run())


def _infer(client: grpcclient.InferenceServerClient, model: str, version: str = ""):  # type: ignore[no-untyped-def]
    inp = grpcclient.InferInput("input", [2, 64], "FP32")
    inp.set_data_from_numpy(np.ones((2, 64), np.float32))
    return client.infer(model, [inp], model_version=version, client_timeout=30)


def _wait(predicate, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_round_trip_push_list_alias_serve_archive(s3_stack: Stack, s3_server: S3Server) -> None:
    stack = s3_stack
    stack.push(stack.model_dir, "fraud", "1")  # stable
    stack.wait_model_ready("fraud")
    _registry(stack, lambda c: c.push(stack.model_dir, "fraud", "2", aliases=["canary"]))

    models = _registry(stack, lambda c: c.list_models())
    fraud = next(m for m in models if m.name == "fraud")
    assert list(fraud.versions) == ["1", "2"]
    assert dict(fraud.aliases) == {"stable": "1", "latest": "2", "canary": "2"}

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        assert _infer(client, "fraud").get_response().model_version == "1"
        _wait(lambda: client.is_model_ready("fraud", "2"), what="v2 ready (canary alias)")
        assert _infer(client, "fraud", "2").as_numpy("probabilities").shape == (2, 2)

        # Archiving the serving version is refused, naming the alias.
        with pytest.raises(Exception, match="alias 'stable'"):
            _registry(stack, lambda c: c.archive("fraud", "1"))
        _registry(stack, lambda c: c.set_alias("fraud", "stable", "2"))
        _wait(lambda: _infer(client, "fraud").get_response().model_version == "2", what="v2")
        info = _registry(stack, lambda c: c.archive("fraud", "1", requested_by="e2e"))
        assert list(info.archived) == ["1"]

        # The worker unloads v1 (after its grace); a pinned request no longer finds it.
        _wait(lambda: not client.is_model_ready("fraud", "1"), what="v1 unloaded")
        with pytest.raises(InferenceServerException, match="no version '1'"):
            _infer(client, "fraud", "1")
        assert _infer(client, "fraud").get_response().model_version == "2"
    finally:
        client.close()

    names = {
        o.object_name
        for o in s3_server.client().list_objects(stack.bucket, recursive=True)  # type: ignore[attr-defined]
    }
    assert "models/fraud/1/archived.json" in names  # archived: files kept
    assert "models/fraud/1/model.onnx" in names and "models/fraud/2/model.onnx" in names


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_triton_repository_extension(s3_stack: Stack, protocol: str) -> None:
    stack = s3_stack
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(stack.grpc_url)
    else:
        client = httpclient.InferenceServerClient(stack.http_url, network_timeout=120)
    try:

        def index() -> dict[tuple[str, str], dict[str, str]]:
            if protocol == "grpc":
                resp = client.get_model_repository_index(as_json=True)
                rows = resp.get("models", [])
            else:
                rows = client.get_model_repository_index()
            return {(r["name"], r.get("version", "")): r for r in rows}

        rows = index()
        assert rows[("fraud", "2")]["state"] == "READY"
        assert rows[("fraud", "1")]["state"] == "UNAVAILABLE"
        assert rows[("fraud", "1")]["reason"] == "archived"
        assert client.is_model_ready("fraud")

        client.unload_model("fraud")
        assert not client.is_model_ready("fraud")  # at once: the route is withdrawn
        assert index()[("fraud", "2")]["reason"] == "unloaded"
        with pytest.raises(InferenceServerException):
            if protocol == "grpc":
                _infer(client, "fraud")
            else:
                inp = httpclient.InferInput("input", [1, 64], "FP32")
                inp.set_data_from_numpy(np.ones((1, 64), np.float32))
                client.infer("fraud", [inp])

        # Wait until the worker really unloaded it, so the load below is a cold one.
        worker = stack.workers[0]
        _wait(
            lambda: "fraud/2" not in httpx.get(worker.readyz_url(), timeout=5).text,
            what="worker unloads fraud/2",
        )
        t0 = time.monotonic()
        client.load_model("fraud")  # returns once a worker reports it ready
        print(f"{protocol} load_model took {time.monotonic() - t0:.2f}s")
        assert client.is_model_ready("fraud")
        assert index()[("fraud", "2")]["state"] == "READY"
        with pytest.raises(InferenceServerException, match=r"no model|not known"):
            client.load_model("no-such-model")
        with pytest.raises(InferenceServerException, match="not supported"):
            client.load_model("fraud", config=json.dumps({"max_batch_size": 8}))
    finally:
        client.close()


def test_load_policy_lazy(s3_stack: Stack, tmp_path: Path) -> None:
    stack = s3_stack
    model_dir = make_fraud_model(tmp_path / "lazy")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(name="fraudlazy", load_policy="lazy")
    (model_dir / "config.json").write_text(json.dumps(config))
    stack.push(model_dir, "fraudlazy", "1")

    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        # Routed but not loaded: the worker reports it lazy, nobody serves it yet.
        def reason() -> str:
            rows = client.get_model_repository_index(as_json=True).get("models", [])
            return next(r.get("reason", "") for r in rows if r["name"] == "fraudlazy")

        _wait(lambda: reason() == "lazy", timeout=30, what="worker reports lazy")
        time.sleep(1.0)
        assert reason() == "lazy" and not client.is_model_ready("fraudlazy")

        # The first request triggers the load and gets its answer within its deadline,
        # or a clear "loading, retry"; a retry is served.
        t0 = time.monotonic()
        answers, retries = 0, 0
        while answers == 0:
            assert time.monotonic() - t0 < 60, "lazy version never served"
            try:
                _infer(client, "fraudlazy")
                answers += 1
            except InferenceServerException as exc:
                assert exc.status() == "StatusCode.UNAVAILABLE", exc
                assert "loading" in str(exc) and "retry" in str(exc)
                retries += 1
        print(f"lazy first answer after {time.monotonic() - t0:.2f}s ({retries} retries)")
        assert client.is_model_ready("fraudlazy")
    finally:
        client.close()
