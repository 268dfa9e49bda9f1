"""Pools on the worker side: its spec in the heartbeat, and a quota that keeps a worker
over it out (not ready, serving nothing) until there is room. Real nats-server."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import nats
import pytest

from inferbus_common.catalog import DeployedVersion, Route, WorkerStatus, ensure_kv
from inferbus_common.catalogrecords import PoolSpec
from inferbus_common.subjects import Subjects, subject_token
from inferbus_worker import hostspec
from inferbus_worker.artifacts import ArtifactCache
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.worker import Worker

_prefixes = itertools.count()


async def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll `predicate` (a real condition) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _settings(nats_url: str, prefix: str, name: str, cache: Path) -> WorkerSettings:
    return WorkerSettings(
        nats_url=nats_url,
        subject_prefix=prefix,
        instance_id=name,
        metrics_port=0,
        cache_dir=cache,
        registry_url="127.0.0.1:9",  # warm cache: no registry needed
        heartbeat_s=0.2,
        load_retry_s=0.3,
        drain_timeout_s=5.0,
        unload_grace_s=0.2,
    )


def _fill_cache(cache: Path, fraud_dir: Path, dv: DeployedVersion) -> None:
    target = ArtifactCache(cache, "").version_dir(dv.model, dv.version)
    target.mkdir(parents=True)
    for name in dv.files:
        shutil.copy(fraud_dir / name, target / name)


async def test_quota_keeps_the_second_worker_out_until_there_is_room(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    prefix = f"tp{next(_prefixes)}"
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        models = await ensure_kv(js, subjects.models_bucket)
        routes = await ensure_kv(js, subjects.routes_bucket)
        pools = await ensure_kv(js, subjects.pools_bucket)
        workers_kv = await ensure_kv(js, subjects.workers_bucket)
        dv = fraud_deployed
        await models.put(subjects.model_key(dv.model, dv.version), dv.model_dump_json().encode())
        route = Route(model=dv.model, stable=dv.version, versions=[dv.version])
        await routes.put(subjects.model_key(dv.model), route.model_dump_json().encode())
        await pools.put(
            subject_token("default"),
            PoolSpec(name="default", max_workers=1).model_dump_json().encode(),
        )
        for name in ("wa", "wb"):
            _fill_cache(tmp_path / name, fraud_dir, dv)

        async with Worker(_settings(nats_url, prefix, "wa", tmp_path / "wa")) as a:
            await wait_until(lambda: a.states.get(("fraud", "1")) == "ready")
            assert a.readiness()[0]
            b = Worker(_settings(nats_url, prefix, "wb", tmp_path / "wb"))
            async with b:
                await wait_until(lambda: bool(b.admission))
                ready, reason = b.readiness()
                assert not ready and "pool 'default' is full: max_workers 1" in reason
                assert "inferbus pools set default --max-workers" in reason
                await asyncio.sleep(0.5)
                assert ("fraud", "1") not in b.states  # serves nothing while out
                # Its heartbeat says so, with its spec.
                await wait_until(lambda: b.status().admitted is False)
                entry = await workers_kv.get(subject_token("wb"))
                status = WorkerStatus.model_validate_json(entry.value)
                assert status.admitted is False and "is full" in status.reason
                assert status.cpus >= 1 and status.memory_bytes > 0
                assert status.joined_unix_ms >= a.joined_unix_ms

                # The first worker leaves: the second one is admitted and loads.
                await a.drain()
                await wait_until(lambda: not b.admission)
                await wait_until(lambda: b.states.get(("fraud", "1")) == "ready")
                assert b.readiness()[0]
    finally:
        await nc.close()


async def test_raising_the_quota_admits_a_waiting_worker(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    prefix = f"tp{next(_prefixes)}"
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        pools = await ensure_kv(js, subjects.pools_bucket)
        await pools.put(
            subject_token("default"),
            PoolSpec(name="default", max_workers=1).model_dump_json().encode(),
        )
        async with (
            Worker(_settings(nats_url, prefix, "w1", tmp_path / "w1")) as first,
            Worker(_settings(nats_url, prefix, "w2", tmp_path / "w2")) as second,
        ):
            await wait_until(lambda: bool(second.admission) and not first.admission)
            await pools.put(
                subject_token("default"),
                PoolSpec(name="default", max_workers=2).model_dump_json().encode(),
            )
            await wait_until(lambda: not second.admission)
            assert second.readiness()[0]
    finally:
        await nc.close()


# --- the spec ----------------------------------------------------------------------


def test_cuda_visible_devices_filters_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferbus_common import gpus

    host = [
        gpus.GpuInfo(0, "GPU-aaa", "NVIDIA H200", 1 << 30, 1 << 30),
        gpus.GpuInfo(1, "GPU-bbb", "NVIDIA H200", 1 << 30, 1 << 30),
    ]
    monkeypatch.setattr(gpus, "host_gpus", lambda: host)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    spec = hostspec.detect()
    assert (spec.gpu_count, spec.gpu_type, spec.gpu_uuids) == (1, "NVIDIA H200", ("GPU-bbb",))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hostspec.detect().gpu_uuids == ()


def test_cgroup_limits_cap_cpus_and_memory(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "memory.max").write_text(str(512 << 20) + "\n")
    assert hostspec.cpu_count(tmp_path) == min(2, hostspec.cpu_count(tmp_path / "none"))
    assert hostspec.memory_bytes(tmp_path) == 512 << 20
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert hostspec.memory_bytes(tmp_path) == hostspec.memory_bytes(tmp_path / "none") > 0
    assert hostspec.cpu_count(tmp_path) >= 1


def test_detect_never_raises_and_reports_this_machine() -> None:
    spec = hostspec.detect()
    assert spec.cpus >= 1 and spec.memory_bytes > 0
    assert spec.gpu_count >= 0 and (spec.gpu_count == 0) == (spec.gpu_type == "")
