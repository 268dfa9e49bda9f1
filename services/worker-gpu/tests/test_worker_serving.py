"""The worker against a real nats-server: catalog → load → pull → reply → ack.

The artifact cache is filled beforehand, so no registry is needed (a warm
cache serves on its own). Each test uses its own subject prefix, so streams,
consumers and buckets of different tests never meet on the shared server.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import nats
import numpy as np
import onnxruntime as ort
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.catalog import DeployedVersion, Route, WorkerStatus, ensure_kv
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import BatchEntry, encode_joined_batch
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects
from inferbus_testing.answers import Answer, answers_of
from inferbus_worker.artifacts import ArtifactCache
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.worker import Worker

pytestmark = pytest.mark.integration

_prefixes = itertools.count()


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `predicate` (a real condition) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def metric(name: str, **labels: str) -> float:
    """Current value of a sample in the process-wide registry (0 when absent)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Deployment:
    """A test's NATS client, naming scheme, worker and helpers."""

    def __init__(self, nc: Client, subjects: Subjects, worker: Worker, deployed: DeployedVersion):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subjects = subjects
        self.worker = worker
        self.deployed = deployed
        self.replies: dict[str, Answer] = {}
        self._tokens = itertools.count(1)
        self.reply_prefix = f"rep.{subjects.prefix}"

    async def collect(self) -> None:
        async def on_reply(msg: Msg) -> None:
            for answer in answers_of(msg):
                self.replies[msg.subject.rsplit(".", 1)[1]] = answer

        await self.nc.subscribe(f"{self.reply_prefix}.*", cb=on_reply)
        await bus.sync(self.nc)

    async def publish(self, data: bytes) -> None:
        subject = self.subjects.batch("default", self.deployed.model, self.deployed.version)
        await self.js.publish(subject, data)

    def entry(self, rid: str, rows: int, *, deadline_ns: int | None = None) -> BatchEntry:
        deadline = h.deadline_from_timeout(30) if deadline_ns is None else deadline_ns
        return BatchEntry(
            rid, f"{self.reply_prefix}.{rid}", deadline, h.now_ns(), rows, token=next(self._tokens)
        )

    async def wait_replies(self, *ids: str, timeout: float = 10.0) -> list[Answer]:
        await wait_until(lambda: all(i in self.replies for i in ids), timeout)
        return [self.replies[i] for i in ids]

    async def consumer_idle(self) -> None:
        """Wait until the consumer has nothing pending or un-acked."""
        name = self.subjects.batch_consumer("default", self.deployed.model, self.deployed.version)
        deadline = time.monotonic() + 10
        while True:
            info = await self.js.consumer_info(self.subjects.batch_stream, name)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
            assert time.monotonic() < deadline, f"consumer not idle: {info}"
            await asyncio.sleep(0.02)


def fill_cache(cache_dir: Path, fraud_dir: Path, dv: DeployedVersion) -> None:
    target = ArtifactCache(cache_dir, "").version_dir(dv.model, dv.version)
    target.mkdir(parents=True)
    for name in dv.files:
        shutil.copy(fraud_dir / name, target / name)


def worker_settings(nats_url: str, prefix: str, cache_dir: Path, **extra: object) -> WorkerSettings:
    fields: dict[str, object] = {
        "nats_url": nats_url,
        "subject_prefix": prefix,
        "instance_id": f"worker-{prefix}",
        "metrics_port": 0,
        "cache_dir": cache_dir,
        # Nothing listens there: these tests prove a warm cache needs no registry.
        "registry_url": "127.0.0.1:9",
        "heartbeat_s": 0.2,
        "fetch_timeout_s": 0.2,
        "load_retry_s": 0.5,
        "drain_timeout_s": 5.0,
        "unload_grace_s": 0.3,
    }
    fields.update(extra)
    return WorkerSettings(**fields)


async def put_catalog(js: JetStreamContext, subjects: Subjects, dv: DeployedVersion) -> None:
    models = await ensure_kv(js, subjects.models_bucket)
    routes = await ensure_kv(js, subjects.routes_bucket)
    await models.put(Subjects.model_key(dv.model, dv.version), dv.model_dump_json().encode())
    route = Route(model=dv.model, stable=dv.version, versions=[dv.version])
    await routes.put(Subjects.model_key(dv.model), route.model_dump_json().encode())


@pytest.fixture
async def deployment(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> AsyncIterator[Deployment]:
    prefix = f"tw{next(_prefixes)}"
    subjects = Subjects(prefix)
    fill_cache(tmp_path / "cache", fraud_dir, fraud_deployed)
    nc = await nats.connect(nats_url)
    try:
        await put_catalog(nc.jetstream(), subjects, fraud_deployed)
        settings = worker_settings(nats_url, prefix, tmp_path / "cache")
        async with Worker(settings) as worker:
            await wait_until(lambda: worker.states.get(("fraud", "1")) == "ready")
            dep = Deployment(nc, subjects, worker, fraud_deployed)
            await dep.collect()
            yield dep
    finally:
        await nc.close()


def reference(fraud_dir: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(fraud_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(["probabilities"], {"input": x})[0]


async def test_each_request_gets_its_rows(deployment: Deployment, fraud_dir: Path) -> None:
    dep = deployment
    rows_before = metric("inferbus_worker_rows_total", model="fraud", version="1")
    x = np.random.default_rng(7).normal(size=(6, 64)).astype(np.float32)
    entries = [dep.entry("a", 1), dep.entry("b", 2), dep.entry("c", 3)]
    entries[1].traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await dep.publish(encode_joined_batch(entries, [[tensor_from_numpy("input", x)]]))
    replies = await dep.wait_replies("a", "b", "c")
    want = reference(fraud_dir, x)
    for msg, (lo, hi), e in zip(replies, [(0, 1), (1, 3), (3, 6)], entries, strict=True):
        assert h.STATUS not in msg.headers
        assert msg.token == e.token
        assert msg.headers[h.VERSION] == "1"
        assert msg.headers[h.DIGEST] == dep.deployed.digest
        assert msg.headers[h.BATCH_SIZE] == "6"
        timings = h.parse_timings(msg.headers[h.TIMINGS])
        assert set(timings) == {"queue", "compute"} and timings["compute"] > 0
        (tensor,) = decode_tensors(msg.data)
        assert tensor.name == "probabilities" and tensor.shape == (hi - lo, 2)
        np.testing.assert_allclose(tensor.as_numpy(), want[lo:hi], rtol=1e-5, atol=1e-6)
    await dep.consumer_idle()
    assert metric("inferbus_worker_rows_total", model="fraud", version="1") == rows_before + 6


async def test_expired_request_is_answered_and_not_computed(
    deployment: Deployment, fraud_dir: Path
) -> None:
    dep = deployment
    rows_before = metric("inferbus_worker_rows_total", model="fraud", version="1")
    x = np.random.default_rng(8).normal(size=(5, 64)).astype(np.float32)
    entries = [
        dep.entry("live1", 2),
        dep.entry("late", 2, deadline_ns=h.now_ns() - 1_000_000),
        dep.entry("live2", 1),
    ]
    await dep.publish(encode_joined_batch(entries, [[tensor_from_numpy("input", x)]]))
    live1, late, live2 = await dep.wait_replies("live1", "late", "live2")
    assert late.headers[h.STATUS] == "DEADLINE_EXCEEDED"
    assert late.data == b""
    want = reference(fraud_dir, np.concatenate([x[0:2], x[4:5]]))
    np.testing.assert_allclose(decode_tensors(live1.data)[0].as_numpy(), want[0:2], rtol=1e-5)
    np.testing.assert_allclose(decode_tensors(live2.data)[0].as_numpy(), want[2:3], rtol=1e-5)
    assert live1.headers[h.BATCH_SIZE] == "3"
    await dep.consumer_idle()
    # Only the three live rows ran on the engine.
    assert metric("inferbus_worker_rows_total", model="fraud", version="1") == rows_before + 3
    assert (
        metric(
            "inferbus_worker_replies_total", model="fraud", version="1", status="DEADLINE_EXCEEDED"
        )
        >= 1
    )


async def test_all_expired_batch_is_acked_without_compute(deployment: Deployment) -> None:
    dep = deployment
    rows_before = metric("inferbus_worker_rows_total", model="fraud", version="1")
    x = np.zeros((1, 64), np.float32)
    entry = dep.entry("gone", 1, deadline_ns=h.now_ns() - 1)
    await dep.publish(encode_joined_batch([entry], [[tensor_from_numpy("input", x)]]))
    (reply,) = await dep.wait_replies("gone")
    assert reply.headers[h.STATUS] == "DEADLINE_EXCEEDED"
    await dep.consumer_idle()
    assert metric("inferbus_worker_rows_total", model="fraud", version="1") == rows_before


async def test_garbage_is_terminated_and_worker_keeps_serving(deployment: Deployment) -> None:
    dep = deployment
    garbage_before = metric(
        "inferbus_worker_batches_total", model="fraud", version="1", outcome="garbage"
    )
    await dep.publish(b"definitely not a micro-batch")
    await dep.publish(b"IBB3\xff\xff\xff\xff")
    await wait_until(
        lambda: (
            metric("inferbus_worker_batches_total", model="fraud", version="1", outcome="garbage")
            == garbage_before + 2
        )
    )
    await dep.consumer_idle()
    x = np.ones((1, 64), np.float32)
    await dep.publish(
        encode_joined_batch([dep.entry("after", 1)], [[tensor_from_numpy("input", x)]])
    )
    (reply,) = await dep.wait_replies("after")
    assert h.STATUS not in reply.headers


async def test_input_the_model_rejects_is_answered_invalid(deployment: Deployment) -> None:
    dep = deployment
    x = np.zeros((2, 10), np.float32)
    entries = [dep.entry("w1", 1), dep.entry("w2", 1)]
    await dep.publish(encode_joined_batch(entries, [[tensor_from_numpy("input", x)]]))
    replies = await dep.wait_replies("w1", "w2")
    for msg in replies:
        assert msg.headers[h.STATUS] == "INVALID_ARGUMENT"
        assert "shape" in msg.headers[h.ERROR]
    await dep.consumer_idle()
    info = await dep.js.consumer_info(
        dep.subjects.batch_stream, dep.subjects.batch_consumer("default", "fraud", "1")
    )
    assert info.num_redelivered == 0


async def test_unknown_output_fails_only_that_request(deployment: Deployment) -> None:
    dep = deployment
    x = np.zeros((2, 64), np.float32)
    good, bad = dep.entry("good", 1), dep.entry("bad", 1)
    good.outputs = ("probabilities",)
    bad.outputs = ("logits",)
    await dep.publish(encode_joined_batch([good, bad], [[tensor_from_numpy("input", x)]]))
    good_msg, bad_msg = await dep.wait_replies("good", "bad")
    assert h.STATUS not in good_msg.headers
    assert bad_msg.headers[h.STATUS] == "INVALID_ARGUMENT"


async def test_heartbeat_metrics_and_readiness(deployment: Deployment) -> None:
    dep = deployment
    kv = await dep.js.key_value(dep.subjects.workers_bucket)
    entry = await kv.get(dep.worker.instance_id)
    status = WorkerStatus.model_validate_json(entry.value)
    assert status.models == {"fraud/1": "ready"}
    assert status.pool == "default"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{dep.worker.metrics_port}") as http:
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        assert "fraud/1: ready" in ready.json()["reason"]
        assert (await http.get("/healthz")).status_code == 200
        text = (await http.get("/metrics")).text
    assert "inferbus_worker_rows_total" in text
    assert "inferbus_worker_models_loaded" in text


async def test_unloads_when_the_route_moves_away(deployment: Deployment) -> None:
    dep = deployment
    routes = await dep.js.key_value(dep.subjects.routes_bucket)
    route = Route(model="fraud", stable="2", versions=["1", "2"])
    t0 = time.monotonic()
    await routes.put(Subjects.model_key("fraud"), route.model_dump_json().encode())
    await wait_until(lambda: ("fraud", "1") not in dep.worker.states)
    # Make-before-break: it kept serving for the grace period first.
    assert time.monotonic() - t0 >= 0.3
    assert dep.worker.runners == {}
    # An alias pointing at it brings it back.
    route = Route(model="fraud", stable="2", versions=["1", "2"], aliases={"canary": "1"})
    await routes.put(Subjects.model_key("fraud"), route.model_dump_json().encode())
    await wait_until(lambda: dep.worker.states.get(("fraud", "1")) == "ready")


async def test_clean_shutdown_deletes_the_heartbeat(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    prefix = f"tw{next(_prefixes)}"
    subjects = Subjects(prefix)
    fill_cache(tmp_path / "cache", fraud_dir, fraud_deployed)
    nc = await nats.connect(nats_url)
    try:
        await put_catalog(nc.jetstream(), subjects, fraud_deployed)
        async with Worker(worker_settings(nats_url, prefix, tmp_path / "cache")) as worker:
            await wait_until(lambda: worker.states.get(("fraud", "1")) == "ready")
            kv = await nc.jetstream().key_value(subjects.workers_bucket)
            assert (await kv.get(worker.instance_id)).value
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(worker.instance_id)
    finally:
        await nc.close()


async def test_missing_files_without_registry_fail_the_version(
    nats_url: str, tmp_path: Path, fraud_deployed: DeployedVersion
) -> None:
    prefix = f"tw{next(_prefixes)}"
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        await put_catalog(nc.jetstream(), subjects, fraud_deployed)
        settings = worker_settings(nats_url, prefix, tmp_path / "empty-cache", registry_timeout_s=2)
        async with Worker(settings) as worker:
            await wait_until(
                lambda: worker.states.get(("fraud", "1"), "").startswith("failed:"), timeout=15
            )
            assert "registry could not deliver" in worker.states[("fraud", "1")]
            ok, reason = worker.readiness()
            assert ok and "failed" in reason
    finally:
        await nc.close()
