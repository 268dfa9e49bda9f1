"""The LLM worker reports like the tensor worker (shared `Heartbeat`): its host spec in
the heartbeat, and a pool quota that keeps a worker over it out (not ready, serving
nothing) until there is room. Real nats-server; no generative version is placed, so
vLLM is not needed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import nats
import nats.js.errors
from nats.js.kv import KeyValue

from inferbus_common.catalog import WorkerStatus, ensure_kv
from inferbus_common.catalogrecords import PoolSpec
from inferbus_common.subjects import Subjects, subject_token
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.worker import LlmWorker

_prefixes = itertools.count()


async def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll `predicate` (a real condition) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _settings(nats_url: str, prefix: str, name: str, cache: Path) -> LlmWorkerSettings:
    return LlmWorkerSettings(
        nats_url=nats_url,
        subject_prefix=prefix,
        instance_id=name,
        metrics_port=0,
        cache_dir=cache,
        device="cpu",
        heartbeat_s=0.2,
        load_retry_s=0.3,
        drain_timeout_s=5.0,
    )


async def test_llm_heartbeat_carries_the_spec_and_the_pool_quota_applies(
    nats_url: str, tmp_path: Path
) -> None:
    prefix = f"tl{next(_prefixes)}"
    subjects = Subjects(prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        pools = await ensure_kv(js, subjects.pools_bucket)
        workers_kv = await ensure_kv(js, subjects.workers_bucket)
        await pools.put(
            subject_token("llm"), PoolSpec(name="llm", max_workers=1).model_dump_json().encode()
        )
        async with LlmWorker(_settings(nats_url, prefix, "la", tmp_path / "la")) as first:
            await wait_until(lambda: first.status().cpus >= 1)
            async with LlmWorker(_settings(nats_url, prefix, "lb", tmp_path / "lb")) as second:
                await wait_until(lambda: bool(second.admission))
                assert not first.admission and first.readiness()[0]
                ready, reason = second.readiness()
                assert not ready and "pool 'llm' is full: max_workers 1" in reason
                await wait_until(lambda: second.status().admitted is False)
                entry = await workers_kv.get(subject_token("lb"))
                status = WorkerStatus.model_validate_json(entry.value or b"")
                assert status.pool == "llm" and status.admitted is False
                assert "is full" in status.reason
                assert status.cpus >= 1 and status.memory_bytes > 0
                assert status.joined_unix_ms >= first.status().joined_unix_ms

                await pools.put(
                    subject_token("llm"),
                    PoolSpec(name="llm", max_workers=2).model_dump_json().encode(),
                )
                await wait_until(lambda: not second.admission)
                assert second.readiness()[0]
        # Leaving deletes the record: the pool's place frees at once.
        keys = await _keys(workers_kv)
        assert subject_token("la") not in keys and subject_token("lb") not in keys
    finally:
        await nc.close()


async def _keys(kv: KeyValue) -> list[str]:
    try:
        return await kv.keys()
    except nats.js.errors.NoKeysError:
        return []
