"""/readyz of a tensor worker says ready only once it can serve: before NATS, before the
catalog, and while its only placed version is still loading, it answers 503. Real
nats-server; the worker's own HTTP endpoint is polled through its whole start."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from pathlib import Path

import httpx
import nats

from inferbus_common.catalog import DeployedVersion, Route, ensure_kv
from inferbus_common.subjects import Subjects
from inferbus_worker.artifacts import ArtifactCache
from inferbus_worker.settings import WorkerSettings
from inferbus_worker.worker import Worker

_prefixes = itertools.count()


async def test_readyz_is_503_until_the_placed_version_is_ready(
    nats_url: str, tmp_path: Path, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    prefix = f"tr{next(_prefixes)}"
    subjects = Subjects(prefix)
    dv = fraud_deployed
    target = ArtifactCache(tmp_path, "").version_dir(dv.model, dv.version)
    target.mkdir(parents=True)
    for name in dv.files:
        shutil.copy(fraud_dir / name, target / name)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        models = await ensure_kv(js, subjects.models_bucket)
        routes = await ensure_kv(js, subjects.routes_bucket)
        await models.put(subjects.model_key(dv.model, dv.version), dv.model_dump_json().encode())
        route = Route(model=dv.model, stable=dv.version, versions=[dv.version])
        await routes.put(subjects.model_key(dv.model), route.model_dump_json().encode())
        worker = Worker(
            WorkerSettings(
                nats_url=nats_url,
                subject_prefix=prefix,
                instance_id="ready-w",
                metrics_port=0,
                cache_dir=tmp_path,
                registry_url="127.0.0.1:9",  # warm cache: no registry needed
                heartbeat_s=0.2,
                load_retry_s=0.3,
                drain_timeout_s=5.0,
            )
        )
        assert worker.readiness() == (False, "not connected to NATS")
        seen: list[tuple[int, str]] = []
        done = asyncio.Event()

        async def poll() -> None:
            async with httpx.AsyncClient(timeout=2.0) as http:
                while not done.is_set():
                    if worker.metrics_port:
                        url = f"http://127.0.0.1:{worker.metrics_port}/readyz"
                        try:
                            r = await http.get(url)
                        except httpx.TransportError:  # bound, not listening yet
                            await asyncio.sleep(0.005)
                            continue
                        seen.append((r.status_code, r.json()["reason"]))
                    await asyncio.sleep(0.005)

        poller = asyncio.create_task(poll())
        try:
            async with worker:
                deadline = time.monotonic() + 20
                while not (seen and seen[-1][0] == 200):
                    assert time.monotonic() < deadline, seen[-5:]
                    await asyncio.sleep(0.01)
        finally:
            done.set()
            await poller
        assert worker.readiness() == (False, "not connected to NATS")
    finally:
        await nc.close()
    ready = [reason for status, reason in seen if status == 200]
    not_ready = [reason for status, reason in seen if status != 200]
    assert all("fraud/1: ready" in reason for reason in ready), ready
    # What it said while not ready: one of the start-up states, never an empty reason.
    assert all(
        r in ("not connected to NATS", "catalog not loaded") or "fraud/1: loading" in r
        for r in not_ready
    ), set(not_ready)
    print(f"/readyz polled {len(seen)} times: {len(not_ready)} x 503 then {len(ready)} x 200")
