"""Payload capture and the drift monitor, against a real nats-server."""

from __future__ import annotations

import itertools
import time

import numpy as np
from nats.aio.client import Client
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.audittrail import ensure_audit_stream, read_captures
from inferbus_common.catalog import Catalog, DeployedVersion, ensure_kv
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.drift import DriftReport, build_profile
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.subjects import Subjects
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.observation.capture import PayloadCapture
from inferbus_gateway.observation.drift import DriftMonitor

SUBJECTS = Subjects("ib")
CONFIG = ModelConfig.model_validate(
    {
        "name": "m",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
    }
)


def _pair(rid: str, x: np.ndarray, *, degraded: str = "") -> tuple[InferRequest, InferResponse]:
    request = InferRequest("m", "", rid, [tensor_from_numpy("x", x)])
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    response = InferResponse(
        "m", "1", rid, [tensor_from_numpy("y", y)], digest="abc", degraded=degraded
    )
    return request, response


async def test_capture_samples_bounds_and_publishes(nats_client: Client) -> None:
    js = nats_client.jetstream()
    await ensure_audit_stream(js, SUBJECTS, max_age_s=3600, max_bytes=1 << 24)
    draws = itertools.cycle([0.1, 0.9])  # with rate 0.5: every other request
    capture = PayloadCapture(
        nats_client, SUBJECTS, rate=0.5, max_bytes=2048, draw=lambda: next(draws)
    )
    async with capture:
        for i in range(6):
            capture.observe(*_pair(f"r{i}", np.full((2, 4), i, dtype=np.float32)))
        capture.observe(*_pair("big", np.zeros((200, 4), dtype=np.float32)))  # 3.2 kB: skipped
        capture.observe(*_pair("fb", np.zeros((1, 4), dtype=np.float32), degraded="breaker-open"))
        capture.observe(*_pair("fb2", np.zeros((1, 4), dtype=np.float32), degraded="deadline"))
    await bus.sync(nats_client)
    got = [c async for c in read_captures(js, SUBJECTS, "m", "1", since_unix_s=time.time() - 60)]
    assert [c.request_id for c in got] == ["r0", "r2", "r4"]
    assert got[1].inputs[0].as_numpy().tolist() == [[2.0] * 4] * 2
    assert got[1].outputs[0].as_numpy().tolist() == [[8.0], [8.0]]
    assert got[1].digest == "abc"


async def test_capture_only_named_models(nats_client: Client) -> None:
    js = nats_client.jetstream()
    await ensure_audit_stream(js, SUBJECTS, max_age_s=3600, max_bytes=1 << 24)
    capture = PayloadCapture(nats_client, SUBJECTS, rate=1.0, models=["other"])
    async with capture:
        capture.observe(*_pair("r", np.zeros((1, 4), dtype=np.float32)))
    got = [
        c
        async for c in read_captures(
            js, SUBJECTS, "m", "1", since_unix_s=time.time() - 60, fetch_timeout_s=0.3
        )
    ]
    assert got == []


async def test_drift_monitor_computes_publishes_and_exports(nats_client: Client) -> None:
    js = nats_client.jetstream()
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4000, 4))
    # Outputs are profiled too: y = sum(x) shifts when x[1] does.
    profile = build_profile({"x": ref, "y": ref.sum(axis=1, keepdims=True)}, model="m")
    profiles = await ensure_kv(js, SUBJECTS.profiles_bucket, history=1)
    await profiles.put(SUBJECTS.model_key("m", "1"), profile.model_dump_json().encode())
    async with Catalog(js, SUBJECTS) as catalog:
        catalog.versions[("m", "1")] = DeployedVersion(
            model="m", version="1", config=CONFIG, files={"profile.json": "0" * 64}
        )
        catalog.versions[("m", "2")] = DeployedVersion(model="m", version="2", config=CONFIG)
        monitor = DriftMonitor(
            nats_client, catalog, SUBJECTS, rate=1.0, window_rows=500, min_rows=300
        )
        for i in range(20):
            x = rng.normal(size=(25, 4)).astype(np.float32)
            x[:, 1] += 2.0
            request, response = _pair(f"r{i}", x)
            monitor.observe(request, response)
            if i == 5:
                assert await monitor.ingest() == 6
                assert await monitor.evaluate_all() == []  # 150 rows < min_rows
        # A version without a profile is not sampled at all.
        request, response = _pair("v2", np.zeros((1, 4), dtype=np.float32))
        response.version = "2"
        monitor.observe(request, response)
        assert await monitor.ingest() == 14
        (report,) = await monitor.evaluate_all()
        assert report.rows == 500
        assert len(report.features) == 5
        assert {n for n, fd in report.features.items() if fd.psi > 0.2} == {"x[1]", "y[0]"}
        assert await monitor.evaluate_all() == []  # nothing new since
    labels = {"model": "m", "version": "1", "feature": "x[1]"}
    assert (REGISTRY.get_sample_value("inferbus_drift_psi", labels) or 0.0) > 0.2
    kv = await js.key_value(SUBJECTS.drift_bucket)
    stored = DriftReport.model_validate_json((await kv.get("m.1")).value or b"")
    assert stored.features == report.features
