"""`ModelRunner` with engines that fail or block: retries, give-up, back-pressure.

The engines here wrap the real ONNX Runtime engine and only add failures or a
gate, so the bus side (real nats-server, JetStream redelivery) is what is tested.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import nats
import numpy as np
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerInfo
from prometheus_client import REGISTRY

from inferbus_common.bus import ensure_batch_stream
from inferbus_common.catalog import DeployedVersion
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import EngineConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import BatchEntry, encode_joined_batch
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects
from inferbus_testing.answers import Answer, answers_of
from inferbus_worker.engines import EngineError, OnnxRuntimeEngine, TensorRTEngine
from inferbus_worker.execution import InlineRuns, runs_on_gpu
from inferbus_worker.runner import ModelRunner
from inferbus_worker.settings import WorkerSettings

pytestmark = pytest.mark.integration

_prefixes = itertools.count()


class FailingEngine(OnnxRuntimeEngine):
    """Fails its first `failures` runs with an engine error, then computes."""

    def __init__(self, path: Path, failures: int) -> None:
        super().__init__(path, EngineConfig())
        self.failures = failures
        self.calls = 0

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls <= self.failures:
            raise EngineError("simulated device failure")
        return super().run(inputs, output_names)


class GatedEngine(OnnxRuntimeEngine):
    """Holds every run until the gate opens, counting runs in progress."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, EngineConfig())
        self.gate = threading.Event()
        self.running = 0
        self._lock = threading.Lock()

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        with self._lock:
            self.running += 1
        self.gate.wait(10)
        return super().run(inputs, output_names)


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()


async def start_runner(
    nc: Client, engine: OnnxRuntimeEngine, dv: DeployedVersion, **settings: object
) -> tuple[ModelRunner, Subjects, list[Answer]]:
    subjects = Subjects(f"tr{next(_prefixes)}")
    js = nc.jetstream()
    await ensure_batch_stream(js, subjects)
    ws = WorkerSettings(
        nats_url="nats://unused",
        subject_prefix=subjects.prefix,
        fetch_timeout_s=0.2,
        nak_delay_s=0.05,
        **settings,
    )
    engine.load()
    runner = ModelRunner(nc, js, subjects, ws, dv, engine)
    await runner.start()
    replies: list[Answer] = []

    async def on_reply(msg: Msg) -> None:
        replies.extend(answers_of(msg))

    await nc.subscribe(f"rr.{subjects.prefix}.*", cb=on_reply)
    return runner, subjects, replies


async def publish(nc: Client, subjects: Subjects, rid: str) -> None:
    entry = BatchEntry(
        rid, f"rr.{subjects.prefix}.{rid}", h.deadline_from_timeout(30), 0, 1, token=1
    )
    data = encode_joined_batch(
        [entry], [[tensor_from_numpy("input", np.ones((1, 64), np.float32))]]
    )
    await nc.jetstream().publish(subjects.batch("default", "fraud", "1"), data)


async def idle_info(nc: Client, subjects: Subjects, consumer: str) -> ConsumerInfo:
    """Consumer info once nothing is pending or un-acked (acks follow replies)."""
    deadline = time.monotonic() + 10
    while True:
        info = await nc.jetstream().consumer_info(subjects.batch_stream, consumer)
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return info
        assert time.monotonic() < deadline, f"consumer not idle: {info}"
        await asyncio.sleep(0.01)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": "fraud", "version": "1", **labels}) or 0.0


async def test_transient_failure_is_retried(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    redeliveries = sample("inferbus_worker_redeliveries_total")
    engine = FailingEngine(fraud_dir / "model.onnx", failures=1)
    runner, subjects, replies = await start_runner(nc, engine, fraud_deployed)
    try:
        await publish(nc, subjects, "x")
        await wait_until(lambda: len(replies) == 1)
        assert h.STATUS not in replies[0].headers
        assert engine.calls == 2
        assert sample("inferbus_worker_redeliveries_total") == redeliveries + 1
    finally:
        await runner.stop()


async def test_last_delivery_answers_internal(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    engine = FailingEngine(fraud_dir / "model.onnx", failures=100)
    runner, subjects, replies = await start_runner(nc, engine, fraud_deployed, max_deliver=2)
    try:
        await publish(nc, subjects, "y")
        await wait_until(lambda: len(replies) == 1)
        assert replies[0].headers[h.STATUS] == "INTERNAL"
        assert engine.calls == 2
        await idle_info(nc, subjects, runner.consumer)
    finally:
        await runner.stop()


async def test_pulls_only_for_free_slots(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    config = fraud_deployed.config.model_copy(update={"instance_count": 2})
    dv = fraud_deployed.model_copy(update={"config": config})
    engine = GatedEngine(fraud_dir / "model.onnx")
    # Merging off: this is about slots, not about joining waiting batches.
    runner, subjects, replies = await start_runner(nc, engine, dv, max_merge_batches=1)
    try:
        for i in range(5):
            await publish(nc, subjects, f"b{i}")
        await wait_until(lambda: engine.running == 2)
        info = await nc.jetstream().consumer_info(subjects.batch_stream, runner.consumer)
        # Two slots busy: two batches taken, three left in the queue for other workers.
        assert info.num_ack_pending == 2
        assert info.num_pending == 3
        engine.gate.set()
        await wait_until(lambda: len(replies) == 5)
        assert all(h.STATUS not in m.headers for m in replies)
    finally:
        engine.gate.set()
        await runner.stop()


async def test_long_batch_is_kept_in_progress(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    engine = GatedEngine(fraud_dir / "model.onnx")
    runner, subjects, replies = await start_runner(nc, engine, fraud_deployed, ack_wait_s=0.6)
    try:
        await publish(nc, subjects, "slow")
        await wait_until(lambda: engine.running == 1)
        # Hold the batch for several ack waits; in_progress() keeps it ours.
        await asyncio.sleep(1.5)
        engine.gate.set()
        await wait_until(lambda: len(replies) == 1)
        info = await idle_info(nc, subjects, runner.consumer)
        assert info.num_redelivered == 0
        assert engine.running == 1
    finally:
        engine.gate.set()
        await runner.stop()


async def test_waiting_batches_are_merged_into_one_execution(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    merged_before = sample("inferbus_worker_merged_batches_total")
    engine = GatedEngine(fraud_dir / "model.onnx")
    runner, subjects, replies = await start_runner(nc, engine, fraud_deployed)
    try:
        await publish(nc, subjects, "first")
        await wait_until(lambda: engine.running == 1)
        # While the only slot is busy, six more batches queue up in the stream.
        for i in range(6):
            await publish(nc, subjects, f"q{i}")
        engine.gate.set()
        await wait_until(lambda: len(replies) == 7)
        assert all(h.STATUS not in m.headers for m in replies)
        # The six waiting batches ran as one execution (its batch size is 6).
        assert engine.running == 2
        assert {m.headers[h.BATCH_SIZE] for m in replies} == {"1", "6"}
        assert sample("inferbus_worker_merged_batches_total") == merged_before + 6
        await idle_info(nc, subjects, runner.consumer)
    finally:
        engine.gate.set()
        await runner.stop()


async def test_the_merge_honours_preferred_batch_sizes(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    """The worker merges waiting batches by the batcher's rule (`BatchRule`): with
    ``preferred_batch_sizes: [4]`` six waiting one-row batches run as 4 + 2."""
    batching = fraud_deployed.config.batching.model_copy(update={"preferred_batch_sizes": [4]})
    config = fraud_deployed.config.model_copy(update={"batching": batching})
    dv = fraud_deployed.model_copy(update={"config": config})
    engine = GatedEngine(fraud_dir / "model.onnx")
    runner, subjects, replies = await start_runner(nc, engine, dv)
    try:
        await publish(nc, subjects, "first")
        await wait_until(lambda: engine.running == 1)
        for i in range(6):
            await publish(nc, subjects, f"q{i}")
        engine.gate.set()
        await wait_until(lambda: len(replies) == 7)
        sizes = sorted(int(m.headers[h.BATCH_SIZE]) for m in replies)
        assert sizes == [1, 2, 2, 4, 4, 4, 4]
        await idle_info(nc, subjects, runner.consumer)
    finally:
        engine.gate.set()
        await runner.stop()


def test_inline_runs_need_a_short_measured_class() -> None:
    decide = InlineRuns(300e-6)
    # Nothing measured yet: the thread pool, whose run measures the class.
    assert not decide.inline(1)
    decide.observe(1, 20e-6)
    assert decide.inline(1)
    # Rows 2-3 are another class (a batch's time is not proportional to its rows).
    assert not decide.inline(2)
    decide.observe(3, 2e-3)
    assert not decide.inline(2)
    assert not decide.inline(3)
    assert decide.inline(1)


def test_inline_runs_follow_a_slowdown_and_recover() -> None:
    decide = InlineRuns(300e-6, alpha=0.2)
    decide.observe(8, 10e-6)
    assert decide.inline(8)
    # One slow run (5 ms) moves the class to the threads at once ...
    decide.observe(8, 5e-3)
    assert not decide.inline(8)
    # ... and fast runs measured there bring it back.
    runs = 0
    while not decide.inline(8):
        decide.observe(8, 10e-6)
        runs += 1
    assert 1 < runs < 20
    assert decide.average(8) is not None and decide.average(8) <= 300e-6


def test_inline_runs_zero_disables() -> None:
    decide = InlineRuns(0.0)
    decide.observe(1, 1e-6)
    assert not decide.inline(1)


def test_gpu_engines_never_run_inline(fraud_dir: Path) -> None:
    cpu = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig())
    cpu.load()
    assert not runs_on_gpu(cpu)
    cpu._providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert runs_on_gpu(cpu)
    assert runs_on_gpu(TensorRTEngine(fraud_dir / "model.onnx"))


@pytest.mark.parametrize("max_us", [200_000.0, 0.0])
async def test_short_runs_go_inline_after_a_measured_run(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion, max_us: float
) -> None:
    inline_before = sample("inferbus_worker_inline_runs_total")
    engine = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig())
    # A 0.2 s bound, so no stall of this shared machine can push a single-row run over it.
    runner, subjects, replies = await start_runner(
        nc, engine, fraud_deployed, inline_run_max_us=max_us
    )
    try:
        # One batch at a time: every one is a single row of the tiny fraud model.
        for i in range(4):
            await publish(nc, subjects, f"i{i}")
            await wait_until(lambda n=i: len(replies) == n + 1)
        assert all(h.STATUS not in m.headers for m in replies)
        assert len({m.data for m in replies}) == 1  # same input, same answer, inline or not
        inline = sample("inferbus_worker_inline_runs_total") - inline_before
        # The first run (in a thread) measured the class; the next three ran inline.
        assert inline == (3 if max_us else 0)
    finally:
        await runner.stop()


async def test_bundled_requests_get_one_reply_bundle_per_inbox(
    nc: Client, fraud_dir: Path, fraud_deployed: DeployedVersion
) -> None:
    engine = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig())
    runner, subjects, replies = await start_runner(nc, engine, fraud_deployed)
    base = f"rr.{subjects.prefix}"
    deadline = h.deadline_from_timeout(30)
    entries = [
        BatchEntry("a1", f"{base}.gwA", deadline, 0, 2, token=11),
        BatchEntry(
            "b1", f"{base}.gwB", deadline, 0, 1, token=5, mirror=f"{base}.shadowp", mirror_token=900
        ),
        BatchEntry("a2", f"{base}.gwA", deadline, 0, 1, ("nope",), token=12),
        BatchEntry("late", f"{base}.gwB", 1, 0, 1, token=6),
    ]
    x = np.random.default_rng(3).random((5, 64), dtype=np.float32)
    data = encode_joined_batch(entries, [[tensor_from_numpy("input", x)]])
    try:
        await nc.jetstream().publish(subjects.batch("default", "fraud", "1"), data)
        # Expired answers go at once; then gwA, gwB and the mirror.
        await wait_until(lambda: len(replies) == 5)
        got = {(a.subject.rsplit(".", 1)[-1], a.token): a for a in replies}
        assert sorted(got) == [("gwA", 11), ("gwA", 12), ("gwB", 5), ("gwB", 6), ("shadowp", 900)]
        want = engine.run({"input": x}, ["probabilities"])["probabilities"]
        ok, bad = got["gwA", 11], got["gwA", 12]
        assert ok.headers[h.VERSION] == "1" and ok.headers[h.BATCH_SIZE] == "4"
        assert h.STATUS not in ok.headers
        np.testing.assert_allclose(
            decode_tensors(ok.data)[0].as_numpy(), want[0:2], rtol=1e-5, atol=1e-6
        )
        assert bad.headers[h.STATUS] == "INVALID_ARGUMENT" and "nope" in bad.headers[h.ERROR]
        assert got["gwB", 6].headers[h.STATUS] == "DEADLINE_EXCEEDED"
        np.testing.assert_allclose(
            decode_tensors(got["gwB", 5].data)[0].as_numpy(), want[2:3], rtol=1e-5, atol=1e-6
        )
        # The mirror copy is the same answer, under the mirror's token.
        assert got["shadowp", 900].data == got["gwB", 5].data
        await idle_info(nc, subjects, runner.consumer)
    finally:
        await runner.stop()
