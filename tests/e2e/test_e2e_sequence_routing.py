"""The gateway's sequence routing against the workers' sequence runners, in one process.

Both sides of the sequence path without the rest of the stack, so a worker
can be stopped at a chosen moment: a real nats-server; two `SequenceRunner`s
(the worker side, ONNX Runtime on an accumulator model) as workers ``w-a``
and ``w-b``, announced ready through real heartbeat records in the workers
bucket that the gateway's `Catalog` follows; `SequenceRouter` instances as
gateways.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from nats.aio.client import Client

from inferbus_common.catalog import Catalog, DeployedVersion, WorkerStatus, ensure_kv
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import FailedPrecondition, InvalidArgument, Unavailable
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.sequences import SequenceFlags, place
from inferbus_common.subjects import Subjects
from inferbus_gateway.triton.sequences import SequenceRouter, check_sequence_request
from inferbus_testing.tritonmodels import write_simple_string_dyna_sequence
from inferbus_worker.engines import OnnxRuntimeEngine
from inferbus_worker.sequences import SequenceRunner

pytestmark = pytest.mark.integration

SUBJECTS = Subjects("ib")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> tuple[DeployedVersion, Path]:
    out = write_simple_string_dyna_sequence(tmp_path_factory.mktemp("acc"), "acc")
    config = ModelConfig.model_validate_json((out / "config.json").read_text())
    return DeployedVersion(model="acc", version="1", config=config, digest="sha256:x"), out


class Workers:
    """Sequence runners plus the heartbeat records that make them ready."""

    def __init__(self, nc: Client, dv: DeployedVersion, model_dir: Path) -> None:
        self.nc = nc
        self.dv = dv
        self.model_dir = model_dir
        self.runners: dict[str, SequenceRunner] = {}

    async def start(self, worker: str) -> None:
        engine = OnnxRuntimeEngine(self.model_dir / "model.onnx", self.dv.config.engine)
        engine.load()
        runner = SequenceRunner(self.nc, SUBJECTS, worker, self.dv, engine)
        await runner.start()
        self.runners[worker] = runner
        kv = await ensure_kv(self.nc.jetstream(), SUBJECTS.workers_bucket)
        status = WorkerStatus(
            worker_id=worker,
            pool="default",
            models={"acc/1": "ready"},
            ts_ms=int(time.time() * 1000),
        )
        await kv.put(worker, status.model_dump_json().encode())

    async def stop(self, worker: str, *, heartbeat: bool = True) -> None:
        await self.runners.pop(worker).stop()
        if heartbeat:
            kv = await ensure_kv(self.nc.jetstream(), SUBJECTS.workers_bucket)
            await kv.delete(worker)


@pytest.fixture
async def cluster(
    nats_client: Client, deployed: tuple[DeployedVersion, Path]
) -> AsyncIterator[tuple[Workers, Catalog]]:
    workers = Workers(nats_client, *deployed)
    for name in ("w-a", "w-b"):
        await workers.start(name)
    async with Catalog(nats_client.jetstream(), SUBJECTS) as catalog:
        await catalog.wait_loaded()
        assert await catalog.wait_for(lambda: len(catalog.ready_workers("acc", "1")) == 2, 10)
        try:
            yield workers, catalog
        finally:
            for name in list(workers.runners):
                await workers.stop(name, heartbeat=False)


async def _call(
    router: SequenceRouter, dv: DeployedVersion, flags: SequenceFlags, value: int
) -> int:
    reply = await router.call(
        dv,
        flags,
        request_id=f"{flags.id}-{value}",
        tensors=[tensor_from_numpy("INPUT", np.array([[value]], np.int32))],
        outputs=[],
        deadline_ns=time.time_ns() + 10**10,
    )
    reply.raise_for_status()
    (out,) = decode_tensors(reply.frame)
    return int(out.as_numpy().reshape(-1)[0])


async def test_a_sequence_stays_on_its_worker_and_another_gateway_finds_it(
    nats_client: Client, cluster: tuple[Workers, Catalog]
) -> None:
    workers, catalog = cluster
    dv = workers.dv
    first = SequenceRouter(nats_client, catalog, SUBJECTS)
    for sid in range(10, 16):
        assert await _call(first, dv, SequenceFlags(sid, start=True), 5) == 5
        holder = place(["w-a", "w-b"], "acc", "1", sid)
        assert workers.runners[holder].sequences >= 1
        assert await _call(first, dv, SequenceFlags(sid), 2) == 7
    assert sum(r.sequences for r in workers.runners.values()) == 6
    # A gateway that never saw the sequences asks the workers, then knows.
    second = SequenceRouter(nats_client, catalog, SUBJECTS)
    assert await _call(second, dv, SequenceFlags(12), 1) == 8
    assert second.bound == 1
    assert await _call(second, dv, SequenceFlags(12, end=True), 0) == 8 + 12
    assert second.bound == 0


async def test_unknown_sequences_and_lost_workers_are_named(
    nats_client: Client, cluster: tuple[Workers, Catalog]
) -> None:
    workers, catalog = cluster
    dv = workers.dv
    router = SequenceRouter(nats_client, catalog, SUBJECTS)
    with pytest.raises(FailedPrecondition, match="sequence 99 of model 'acc' is not active"):
        await _call(router, dv, SequenceFlags(99), 1)
    sid = next(s for s in range(100, 200) if place(["w-a", "w-b"], "acc", "1", s) == "w-a")
    assert await _call(router, dv, SequenceFlags(sid, start=True), 1) == 1
    # The worker stops without its heartbeat going (a crash): nobody answers its subject.
    await workers.stop("w-a", heartbeat=False)
    with pytest.raises(Unavailable, match=f"sequence {sid} .* held by worker w-a"):
        await _call(router, dv, SequenceFlags(sid), 1)
    # Once the catalog has no ready w-a, a new start goes to w-b.
    kv = await ensure_kv(nats_client.jetstream(), SUBJECTS.workers_bucket)
    await kv.delete("w-a")
    assert await catalog.wait_for(lambda: len(catalog.ready_workers("acc", "1")) == 1, 10)
    assert await _call(router, dv, SequenceFlags(sid, start=True), 3) == 3
    assert workers.runners["w-b"].sequences == 1
    await workers.stop("w-b")
    assert await catalog.wait_for(lambda: not catalog.ready_workers("acc", "1"), 10)
    with pytest.raises(Unavailable, match="held by worker w-b, which no longer serves"):
        await _call(router, dv, SequenceFlags(sid), 1)
    with pytest.raises(Unavailable, match="no ready worker to start sequence 5"):
        await _call(router, dv, SequenceFlags(5, start=True), 1)


async def test_turns_keep_the_order_the_requests_were_taken_in(
    nats_client: Client, cluster: tuple[Workers, Catalog]
) -> None:
    workers, catalog = cluster
    dv = workers.dv
    router = SequenceRouter(nats_client, catalog, SUBJECTS)
    values = [3, 1, 4, 1, 5, 9, 2, 6]
    flags = [SequenceFlags(42, start=(i == 0)) for i in range(len(values))]
    turns = [router.turn("acc", "1", f) for f in flags]

    async def one(i: int) -> int:
        # Later requests reach the router first; their turns hold them back.
        await asyncio.sleep(0.001 * (len(values) - i))
        reply = await router.call(
            dv,
            flags[i],
            request_id=str(i),
            tensors=[tensor_from_numpy("INPUT", np.array([[values[i]]], np.int32))],
            outputs=[],
            deadline_ns=time.time_ns() + 10**10,
            turn=turns[i],
        )
        turns[i].release()
        (out,) = decode_tensors(reply.frame)
        return int(out.as_numpy().reshape(-1)[0])

    results = await asyncio.gather(*(one(i) for i in range(len(values))))
    assert results == np.cumsum(values).tolist()


def test_requests_must_fit_the_models_sequence_batching(
    deployed: tuple[DeployedVersion, Path],
) -> None:
    dv, _ = deployed
    with pytest.raises(InvalidArgument, match="must carry a non-zero"):
        check_sequence_request(dv, None)
    plain = dv.model_copy(
        update={"config": dv.config.model_copy(update={"sequence_batching": None})}
    )
    with pytest.raises(InvalidArgument, match="not a sequence model"):
        check_sequence_request(plain, SequenceFlags(1))
    check_sequence_request(dv, SequenceFlags("text-id"))  # its CORRID is BYTES
