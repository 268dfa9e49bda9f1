"""Every metric the Grafana dashboard and the alert rules query is exported by a
running stack, and docs/metrics.md documents every metric the services define.

The stack (real processes, real redis-server) is driven through the events
that make labelled series appear: answered requests on both protocols, a
model QPS limit and a tenant quota that refuse requests, a request the batcher
refuses (deadline already passed), and traffic to a version that carries a
drift profile. Then every service's /metrics is scraped and each metric name
found in the dashboard JSON and in alerts.yml is looked for (histograms by
their ``_bucket``/``_sum``/``_count`` series, counters by ``_total``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import time
from pathlib import Path

import httpx
import nats
import nats.errors
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc as grpcclient
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from inferbus_client.registry import RegistryClient
from inferbus_common import bus
from inferbus_common.admission.keys import AdmissionKeys
from inferbus_common.admission.limits import Limit, Scope, delete_limit, set_limit
from inferbus_common.drift import build_profile
from inferbus_common.protocol.bundles import (
    BundledRequest,
    decode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission.quota import Quota, delete_quota, set_quota

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "compose" / "grafana" / "dashboards" / "inferbus.json"
ALERTS = REPO / "compose" / "prometheus" / "alerts.yml"
METRICS_DOC = REPO / "docs" / "metrics.md"

STACK_REDIS = True
STACK_ENV = {
    "INFERBUS_GATEWAY_DRIFT_SAMPLE_RATE": "1",
    "INFERBUS_GATEWAY_DRIFT_WINDOW_ROWS": "200",
    "INFERBUS_GATEWAY_DRIFT_MIN_ROWS": "50",
    "INFERBUS_GATEWAY_DRIFT_INTERVAL_S": "0.3",
}
KEYS = AdmissionKeys("ib")

# Metric names in PromQL; `level:metric:operation` recording-rule names are not metrics.
_USED = re.compile(r"(?<![:\w])((?:inferbus|jetstream)_[a-z0-9_]+)(?![:\w])")
_DEFINED = re.compile(
    r"""(Counter|Gauge|Histogram|Summary)(?:MetricFamily)?\(\s*["']([a-zA-Z_:][a-zA-Z0-9_:]*)["']"""
)
NOT_FROM_INFERBUS = {
    "jetstream_consumer_num_pending": "exported by prometheus-nats-exporter (-jsz=all) in "
    "compose, not by an inferbus service",
}
GPU_ONLY = {
    "inferbus_worker_gpu_utilization_ratio",
    "inferbus_worker_gpu_memory_used_bytes",
    "inferbus_worker_gpu_memory_total_bytes",
}


def queried_metrics() -> set[str]:
    """Every metric name used by the dashboard's panels and by the alert rules."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        exprs += [rule["expr"] for rule in group["rules"]]
    return {name for expr in exprs for name in _USED.findall(expr)}


def defined_metrics() -> set[str]:
    """Family names of every metric the services define (counters without ``_total``)."""
    names = set()
    for source in (REPO / "services").glob("*/src/**/*.py"):
        for kind, name in _DEFINED.findall(source.read_text()):
            names.add(name.removesuffix("_total") if kind == "Counter" else name)
    return names


def _nvml_usable() -> bool:
    if importlib.util.find_spec("pynvml") is None:
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    return True


def _status(client: grpcclient.InferenceServerClient, **kw) -> str:
    x = np.random.default_rng(7).standard_normal((1, 64)).astype(np.float32)
    inp = grpcclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    try:
        client.infer("fraud", [inp], **kw)
    except InferenceServerException as exc:
        return exc.status().removeprefix("StatusCode.")
    return "OK"


def _until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen after {timeout}s")
        time.sleep(0.05)


def _scrape(stack) -> dict[str, set[str]]:
    """Sample names on each service's /metrics."""
    out: dict[str, set[str]] = {}
    for name, proc in stack.procs.items():
        text = httpx.get(f"http://127.0.0.1:{proc.ports['metrics']}/metrics", timeout=5).text
        out[name] = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    return out


def _drift_traffic(stack, tmp: Path) -> None:
    """Push fraud version 2 with a reference profile and send it traffic."""
    rng = np.random.default_rng(3)
    profile = build_profile({"input": rng.normal(size=(1000, 64)).astype(np.float32)})
    model = tmp / "fraud-v2"
    shutil.copytree(stack.model_dir, model, ignore=shutil.ignore_patterns(".gitignore"))
    (model / "profile.json").write_text(profile.model_dump_json())

    async def push() -> None:
        async with RegistryClient(stack.registry_url) as client:
            await client.push(model, "fraud", "2", aliases=[])

    asyncio.run(push())
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        _until(lambda: client.is_model_ready("fraud", "2"), "fraud version 2 ready", 60)
        for _ in range(6):
            x = rng.normal(size=(25, 64)).astype(np.float32)
            x[:, 0] += 2.0  # one shifted feature: PSI has something to say
            inp = grpcclient.InferInput("input", [25, 64], "FP32")
            inp.set_data_from_numpy(x)
            client.infer("fraud", [inp], model_version="2")
    finally:
        client.close()


async def _batcher_refusal(stack) -> None:
    """A request whose deadline passed before it reached the batcher: answered there."""
    nc = await nats.connect(stack.nats.url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await bus.sync(nc)
        frame = bytes.fromhex("49425431" + "0000")  # an empty tensor frame (IBT1, 0 tensors)
        env = Envelope("dashboard-expired", "fraud", time.time_ns() - 1_000_000_000)
        body = encode_request_bundle("fraud", "1", inbox, [BundledRequest(env, 1)], [(frame,)])
        for _ in range(50):  # the first publish after a fresh SUB can be dropped: retry
            await nc.publish(Subjects("ib").infer("fraud", "1"), body)
            try:
                reply = await sub.next_msg(timeout=0.5)
                break
            except nats.errors.TimeoutError:
                continue
        else:
            raise AssertionError("the batcher never answered the expired request")
        assert decode_reply_bundle(reply.data).replies[0].status == "DEADLINE_EXCEEDED"
    finally:
        await nc.close()


async def _redis_call(stack, fn, *args) -> None:
    client = aioredis.from_url(stack.redis.url)
    try:
        await fn(client, KEYS, *args)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def exported(stack, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Sample names of the whole stack after the events that make series appear."""
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        for _ in range(5):
            assert _status(client) == "OK"
        body = {
            "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.1] * 64}]
        }
        resp = httpx.post(f"http://{stack.http_url}/v2/models/fraud/infer", json=body, timeout=10)
        assert resp.status_code == 200, resp.text

        # A model QPS limit: refusals with reason model-qps.
        asyncio.run(_redis_call(stack, set_limit, Limit(Scope.MODEL, "fraud", qps=1, burst=1)))
        try:
            _until(lambda: _status(client) == "RESOURCE_EXHAUSTED", "a model-qps refusal")
        finally:
            asyncio.run(_redis_call(stack, delete_limit, Scope.MODEL, "fraud"))
        _until(lambda: _status(client) == "OK", "the limit lifted")

        # A daily quota of the (anonymous) tenant: refusals with period day.
        asyncio.run(_redis_call(stack, set_quota, Quota("anonymous", per_day=1)))
        try:
            _until(lambda: _status(client) == "RESOURCE_EXHAUSTED", "a quota refusal")
        finally:
            asyncio.run(_redis_call(stack, delete_quota, "anonymous"))
        _until(lambda: _status(client) == "OK", "the quota lifted")
    finally:
        client.close()

    asyncio.run(_batcher_refusal(stack))
    _drift_traffic(stack, tmp_path_factory.mktemp("drift"))
    _until(
        lambda: "inferbus_drift_psi" in _scrape(stack)["gateway"],
        "inferbus_drift_psi on the gateway",
    )
    return set().union(*_scrape(stack).values())


def _series(name: str) -> set[str]:
    """The sample names a queried name may come as (it may already be one)."""
    if name.endswith(("_bucket", "_sum", "_count", "_total")):
        return {name}
    return {name, f"{name}_total"}


@pytest.mark.parametrize("name", sorted(queried_metrics()))
def test_queried_metric_is_exported(name: str, exported: set[str]) -> None:
    if name in NOT_FROM_INFERBUS:
        pytest.skip(NOT_FROM_INFERBUS[name])
    if name in GPU_ONLY and not _nvml_usable():
        pytest.skip("GPU metric: exported by workers where NVML (pynvml and a driver) works")
    assert _series(name) & exported, f"{name} is queried but no service exports it"


def test_every_service_is_live_and_ready(stack) -> None:
    for name, proc in stack.procs.items():
        base = f"http://127.0.0.1:{proc.ports['metrics']}"
        live = httpx.get(f"{base}/healthz", timeout=5)
        ready = httpx.get(f"{base}/readyz", timeout=5)
        assert live.status_code == 200 and live.json()["live"] is True, name
        assert ready.status_code == 200 and ready.json()["ready"] is True, (name, ready.text)


def test_docs_metrics_lists_every_metric_the_services_define() -> None:
    doc = METRICS_DOC.read_text()
    documented = set(re.findall(r"`((?:inferbus|jetstream)_[a-z0-9_]+)", doc))
    missing = sorted(
        name
        for name in defined_metrics()
        if name not in documented and f"{name}_total" not in documented
    )
    assert not missing, f"add these to docs/metrics.md: {missing}"
