"""The worker's sequence batcher: order, state, controls, batching, freeing, refusals.

A real nats-server and ONNX Runtime on the ``simple_string_dyna_sequence``
model (implicit state ACC, controls START/END/READY and a string CORRID):
its OUTPUT is the sum of the sequence's inputs so far, plus CORRID on the
end request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import numpy as np
import pytest
from nats.aio.client import Client

from inferbus_common import bus
from inferbus_common.catalog import DeployedVersion
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.tensors import decode_tensors, encode_tensors
from inferbus_common.sequences import encode_sequence_id
from inferbus_common.subjects import Subjects
from inferbus_testing.tritonmodels import write_simple_string_dyna_sequence
from inferbus_worker.engines import OnnxRuntimeEngine
from inferbus_worker.sequences import SEQUENCE_SLOTS_REASON, SequenceRunner

pytestmark = pytest.mark.integration

SUBJECTS = Subjects("ib")
WORKER = "w-seq"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_simple_string_dyna_sequence(tmp_path_factory.mktemp("seq"), "acc")


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.drain()


async def _runner(nc: Client, model_dir: Path, **sequence: object) -> SequenceRunner:
    config = ModelConfig.model_validate_json((model_dir / "config.json").read_text())
    assert config.sequence_batching is not None
    seq = config.sequence_batching.model_copy(update=sequence)
    config = config.model_copy(update={"sequence_batching": seq})
    engine = OnnxRuntimeEngine(model_dir / "model.onnx", config.engine)
    engine.load()
    dv = DeployedVersion(model="acc", version="1", config=config, digest="sha256:x")
    runner = SequenceRunner(nc, SUBJECTS, WORKER, dv, engine)
    await runner.start()
    await bus.sync(nc)
    return runner


async def _send(
    nc: Client, sid: int | str, value: int, *, start: bool = False, end: bool = False
) -> tuple[dict[str, str], int | None]:
    """One request; returns the reply headers and OUTPUT (None on error)."""
    flags = ",".join(f for f, on in (("start", start), ("end", end)) if on)
    headers = {h.REQUEST_ID: f"{sid}-{value}", h.SEQUENCE_ID: encode_sequence_id(sid)}
    if flags:
        headers[h.SEQUENCE_FLAGS] = flags
    frame = encode_tensors([tensor_from_numpy("INPUT", np.array([[value]], np.int32))])
    msg = await nc.request(SUBJECTS.sequence(WORKER, "acc", "1"), frame, 10, headers=headers)
    reply = dict(msg.headers or {})
    if h.STATUS in reply:
        return reply, None
    (out,) = decode_tensors(msg.data)
    return reply, int(out.as_numpy().reshape(-1)[0])


async def _held(nc: Client, sid: int | str) -> bool:
    msg = await nc.request(
        SUBJECTS.sequence_locate("acc", "1"),
        b"",
        5,
        headers={h.SEQUENCE_ID: encode_sequence_id(sid)},
    )
    return msg.data == WORKER.encode()


async def test_state_accumulates_and_the_end_frees_the_sequence(
    nc: Client, model_dir: Path
) -> None:
    runner = await _runner(nc, model_dir)
    try:
        assert (await _send(nc, "1002", 20, start=True))[1] == 20
        assert await _held(nc, "1002") and not await _held(nc, 1002)
        assert (await _send(nc, "1002", -11))[1] == 9
        assert (await _send(nc, "1002", -7))[1] == 2
        # CORRID (the string id, as a number) is added on the end request.
        assert (await _send(nc, "1002", 1, end=True))[1] == 3 + 1002
        assert runner.sequences == 0 and not await _held(nc, "1002")
        reply, out = await _send(nc, "1002", 5)
        assert out is None and reply[h.STATUS] == "FAILED_PRECONDITION"
        assert "sequence '1002'" in reply[h.ERROR] and "sequence_start" in reply[h.ERROR]
        # A new start begins from zero state.
        assert (await _send(nc, "1002", 4, start=True, end=True))[1] == 4 + 1002
    finally:
        await runner.stop()


async def test_requests_sent_without_waiting_run_in_order(nc: Client, model_dir: Path) -> None:
    runner = await _runner(nc, model_dir)
    try:
        values = list(range(1, 21))
        results = await asyncio.gather(
            *(
                _send(nc, 7, v, start=(i == 0), end=(i == len(values) - 1))
                for i, v in enumerate(values)
            )
        )
        sums = np.cumsum(values).tolist()
        sums[-1] += 7
        assert [out for _, out in results] == sums
    finally:
        await runner.stop()


async def test_ready_requests_of_different_sequences_share_a_batch(
    nc: Client, model_dir: Path
) -> None:
    runner = await _runner(nc, model_dir, max_queue_delay_us=300_000)
    try:
        results = await asyncio.gather(*(_send(nc, sid, sid, start=True) for sid in range(1, 5)))
        assert [out for _, out in results] == [1, 2, 3, 4]
        assert max(int(reply[h.BATCH_SIZE]) for reply, _ in results) >= 2
        assert runner.stats.snapshot().inference_count == 4
    finally:
        await runner.stop()


async def test_an_idle_sequence_is_freed(nc: Client, model_dir: Path) -> None:
    runner = await _runner(nc, model_dir, max_sequence_idle_us=100_000)
    try:
        assert (await _send(nc, "77", 3, start=True))[1] == 3
        for _ in range(500):  # the sweep runs every 25 ms; allow a slow machine 10 s
            if not await _held(nc, "77"):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the idle sequence was never freed")
        reply, out = await _send(nc, "77", 1)
        assert out is None and reply[h.STATUS] == "FAILED_PRECONDITION"
        assert "100 ms without a request" in reply[h.ERROR]
    finally:
        await runner.stop()


async def test_starts_beyond_max_sequences_are_refused(nc: Client, model_dir: Path) -> None:
    runner = await _runner(nc, model_dir, max_sequences=2)
    try:
        assert (await _send(nc, 1, 1, start=True))[1] == 1
        assert (await _send(nc, 2, 1, start=True))[1] == 1
        reply, out = await _send(nc, 3, 1, start=True)
        assert out is None and reply[h.STATUS] == "RESOURCE_EXHAUSTED"
        assert reply[h.REASON] == SEQUENCE_SLOTS_REASON
        # A held sequence can still restart, and an ended one makes room.
        assert (await _send(nc, 2, 5, start=True, end=True))[1] == 5 + 2
        assert (await _send(nc, 3, 1, start=True))[1] == 1
    finally:
        await runner.stop()


async def test_a_stopping_runner_refuses_and_answers_what_was_queued(
    nc: Client, model_dir: Path
) -> None:
    runner = await _runner(nc, model_dir)
    assert (await _send(nc, 9, 1, start=True))[1] == 1
    await runner.stop()
    with pytest.raises(nats.errors.NoRespondersError):
        await _send(nc, 9, 1)
