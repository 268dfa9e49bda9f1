"""GPU serving rules that hold on any machine, with a real nats-server and worker:
a GPU-only version on a worker without its provider fails permanently (not "retry
later", never served on the CPU), and an instance group serves with one session
and one execution slot per instance."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import numpy as np
import pytest

from inferbus_common.catalog import DeployedVersion
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import encode_joined_batch
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects
from inferbus_worker.engines import EngineInstances
from inferbus_worker.runner import ModelRunner
from inferbus_worker.worker import Worker

from .test_worker_serving import (
    Deployment,
    fill_cache,
    metric,
    put_catalog,
    reference,
    wait_until,
    worker_settings,
)

pytestmark = pytest.mark.integration

_prefixes = itertools.count()


def _variant(dv: DeployedVersion, **config: object) -> DeployedVersion:
    doc = {**dv.config.model_dump(), **config}
    return dv.model_copy(update={"config": ModelConfig.model_validate(doc)})


@asynccontextmanager
async def _serving(
    nats_url: str, tmp_path: Path, fraud_dir: Path, dv: DeployedVersion
) -> AsyncIterator[Deployment]:
    prefix = f"tg{next(_prefixes)}"
    subjects = Subjects(prefix)
    fill_cache(tmp_path / "cache", fraud_dir, dv)
    nc = await nats.connect(nats_url)
    try:
        await put_catalog(nc.jetstream(), subjects, dv)
        async with Worker(worker_settings(nats_url, prefix, tmp_path / "cache")) as worker:
            dep = Deployment(nc, subjects, worker, dv)
            await dep.collect()
            yield dep
    finally:
        await nc.close()


async def test_gpu_only_version_fails_permanently_without_its_provider(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider: the version would load")
    dv = _variant(fraud_deployed, engine={"providers": ["cuda"]})
    async with _serving(nats_url, tmp_path, fraud_dir, dv) as dep:
        key = ("fraud", "1")
        await wait_until(lambda: dep.worker.states.get(key, "").startswith("failed"), 15)
        state = dep.worker.states[key]
        # "failed permanently": clients get FAILED_PRECONDITION with this text.
        assert state.startswith("failed permanently: ")
        assert "['cuda']" in state and "CPUExecutionProvider" in state
        assert key not in dep.worker.runners


async def test_instance_group_serves_with_a_slot_per_instance(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    dv = _variant(fraud_deployed, instance_group={"count": 2})
    async with _serving(nats_url, tmp_path, fraud_dir, dv) as dep:
        key = ("fraud", "1")
        await wait_until(lambda: dep.worker.states.get(key) == "ready", 15)
        runner = dep.worker.runners[key]
        assert isinstance(runner, ModelRunner)
        engine = runner._engine
        assert isinstance(engine, EngineInstances) and len(engine.instances) == 2
        labels = {"model": "fraud", "version": "1"}
        assert metric("inferbus_worker_execution_slots", **labels) == 2
        xs = {
            f"r{i}": np.random.default_rng(i).normal(size=(3, 64)).astype(np.float32)
            for i in range(6)
        }
        for rid, x in xs.items():
            await dep.publish(
                encode_joined_batch([dep.entry(rid, 3)], [[tensor_from_numpy("input", x)]])
            )
        replies = await dep.wait_replies(*xs)
        for (rid, x), msg in zip(xs.items(), replies, strict=True):
            assert h.STATUS not in (msg.headers or {}), (rid, msg.headers)
            (out,) = decode_tensors(msg.data)
            np.testing.assert_allclose(
                out.as_numpy(), reference(fraud_dir, x), rtol=1e-5, atol=1e-6
            )


async def test_runner_keeps_a_batch_in_flight_per_instance(
    nats_url: str, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    from .test_worker_runner import GatedEngine, publish, start_runner

    dv = _variant(fraud_deployed, instance_group={"count": 2})
    gated = [GatedEngine(fraud_dir / "model.onnx") for _ in range(2)]
    engine = EngineInstances(gated)
    nc = await nats.connect(nats_url)
    runner, subjects, replies = await start_runner(nc, engine, dv, max_merge_batches=1)  # type: ignore[arg-type]
    try:
        for i in range(4):
            await publish(nc, subjects, f"b{i}")
        # Two batches computing at once, one on each instance's own session.
        await wait_until(lambda: all(g.running == 1 for g in gated))
        info = await nc.jetstream().consumer_info(subjects.batch_stream, runner.consumer)
        assert info.num_ack_pending == 2
        for g in gated:
            g.gate.set()
        await wait_until(lambda: len(replies) == 4)
        assert all(h.STATUS not in m.headers for m in replies)
    finally:
        for g in gated:
            g.gate.set()
        await runner.stop()
        await nc.close()
