"""``python -m inferbus_worker`` as a real process: ports file, serving, SIGTERM drain."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import nats
import numpy as np
import pytest
from nats.aio.msg import Msg

from inferbus_common import bus
from inferbus_common.catalog import DeployedVersion, Route, WorkerStatus, ensure_kv
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import BatchEntry, encode_joined_batch
from inferbus_common.subjects import Subjects
from inferbus_testing.answers import Answer, answers_of
from inferbus_testing.processes import ServiceProcess
from inferbus_worker.artifacts import ArtifactCache

pytestmark = pytest.mark.integration

PREFIX = "tproc"


async def wait_for(
    predicate: Callable[[], object],
    timeout: float = 20.0,
    service: ServiceProcess | None = None,
) -> object:
    """Poll an async or plain predicate until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if service is not None and not service.running:
            raise AssertionError(f"worker exited early: {service.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_sigterm_drains_in_flight_batches(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    subjects = Subjects(PREFIX)
    cache = ArtifactCache(tmp_path / "cache", "")
    target = cache.version_dir("fraud", "1")
    target.mkdir(parents=True)
    for name in fraud_deployed.files:
        shutil.copy(fraud_dir / name, target / name)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    models = await ensure_kv(js, subjects.models_bucket)
    routes = await ensure_kv(js, subjects.routes_bucket)
    await models.put(Subjects.model_key("fraud", "1"), fraud_deployed.model_dump_json().encode())
    route = Route(model="fraud", stable="1", versions=["1"])
    await routes.put(Subjects.model_key("fraud"), route.model_dump_json().encode())

    env = {
        "INFERBUS_WORKER_NATS_URL": nats_url,
        "INFERBUS_WORKER_SUBJECT_PREFIX": PREFIX,
        "INFERBUS_WORKER_INSTANCE_ID": "proc-worker",
        "INFERBUS_WORKER_METRICS_PORT": "0",
        "INFERBUS_WORKER_CACHE_DIR": str(tmp_path / "cache"),
        "INFERBUS_WORKER_REGISTRY_URL": "127.0.0.1:9",
        "INFERBUS_WORKER_HEARTBEAT_S": "0.2",
        "INFERBUS_WORKER_FETCH_TIMEOUT_S": "0.2",
        "INFERBUS_WORKER_LOG_LEVEL": "WARNING",
    }
    replies: list[Answer] = []
    service = ServiceProcess("inferbus_worker", env=env, log_dir=tmp_path)
    try:
        await service.astart()
        port = service.ports["metrics"]
        workers = await ensure_kv(js, subjects.workers_bucket)

        async def ready() -> bool:
            try:
                entry = await workers.get("proc-worker")
            except nats.js.errors.KeyNotFoundError:
                return False
            return WorkerStatus.model_validate_json(entry.value).models.get("fraud/1") == "ready"

        await wait_for(ready, service=service)
        async with httpx.AsyncClient() as http:
            r = await http.get(f"http://127.0.0.1:{port}/readyz")
        assert r.status_code == 200 and "fraud/1: ready" in r.json()["reason"]

        async def on_reply(msg: Msg) -> None:
            replies.extend(answers_of(msg))

        await nc.subscribe("procrep.*", cb=on_reply)
        x = np.ones((2, 64), np.float32)
        n_batches = 20
        for i in range(n_batches):
            entries = [
                BatchEntry(f"{i}a", f"procrep.{i}a", h.deadline_from_timeout(60), h.now_ns(), 1),
                BatchEntry(f"{i}b", f"procrep.{i}b", h.deadline_from_timeout(60), h.now_ns(), 1),
            ]
            payload = encode_joined_batch(entries, [[tensor_from_numpy("input", x)]])
            await js.publish(subjects.batch("default", "fraud", "1"), payload)
        # Stop while batches are flowing: drain must finish what it took, ack it and exit 0.
        await wait_for(lambda: len(replies) >= 2, service=service)
        code = await service.aterminate(timeout=20)
        assert code == 0, service.log_tail()
        await bus.sync(nc)
        info = await js.consumer_info(
            subjects.batch_stream, subjects.batch_consumer("default", "fraud", "1")
        )
        # Nothing was left half-done: every batch is either answered and acked, or untouched.
        assert info.num_ack_pending == 0
        assert info.num_redelivered == 0
        answered = len(replies)
        assert answered % 2 == 0
        assert answered // 2 + info.num_pending == n_batches
        assert len({m.subject for m in replies}) == answered
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await workers.get("proc-worker")
    finally:
        service.cleanup()
        await nc.close()
