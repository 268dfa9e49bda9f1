"""A worker killed with batches in hand: those requests are answered OK soon after
the kill (the batches go to the other worker after the short first ack wait),
not at their deadline. docs/reliability.md, "worker kill -9: in-flight batches"."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time

import nats
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_common.subjects import Subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEADLINE_S = 10.0
SENDERS = 16
RECOVERY_BOUND_S = 2.0
"""What the test asserts for every request in flight at the kill: answered OK
this soon after it. Measured here 0.5-0.7 s (the 0.5 s first ack wait plus the
survivor's run); the bound leaves room for a loaded 2-core CI machine while
staying far below the deadline that used to be the answer."""


async def test_requests_on_a_killed_worker_are_answered_soon_after_the_kill(stack) -> None:
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    victim = stack.workers[0]
    subjects = Subjects()
    nc = await nats.connect(stack.nats.url)
    js = nc.jetstream()
    consumer = subjects.batch_consumer("default", "fraud", "1")
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    outcomes: collections.Counter[str] = collections.Counter()
    started: dict[int, float] = {}
    finished: dict[int, tuple[float, str]] = {}
    stop = asyncio.Event()
    ids = iter(range(1_000_000))

    async def sender(k: int) -> None:
        rng = np.random.default_rng(k)
        while not stop.is_set():
            i = next(ids)
            x = rng.standard_normal((1, 64)).astype(np.float32)
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            started[i] = time.monotonic()
            try:
                result = await asyncio.wait_for(
                    client.infer("fraud", [inp], timeout=int(DEADLINE_S * 1e6)), DEADLINE_S + 5
                )
            except TimeoutError:
                status = "HANG"
            except InferenceServerException as exc:
                status = str(exc.status())
            else:
                got = result.as_numpy("probabilities")
                ok = np.allclose(got, session.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6)
                status = "OK" if ok else "WRONG"
            finished[i] = (time.monotonic(), status)
            outcomes[status] += 1

    senders = [asyncio.ensure_future(sender(k)) for k in range(SENDERS)]
    try:
        await asyncio.sleep(1.0)
        # Freeze the victim: batches the server hands its open pull stay there,
        # un-acked. As soon as one does, kill it: that batch is in flight on a
        # dead worker.
        os.kill(victim.pid, signal.SIGSTOP)
        held = 0
        for _ in range(300):
            info = await js.consumer_info(subjects.batch_stream, consumer)
            held = info.num_ack_pending
            if held:
                break
            await asyncio.sleep(0.002)
        killed_at = time.monotonic()
        victim.kill()
        in_flight = [i for i, t in started.items() if t < killed_at and i not in finished]
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*senders), DEADLINE_S + 10)
    finally:
        stop.set()
        for task in senders:
            task.cancel()
        await client.close()
        await nc.close()

    assert held >= 1, "the frozen worker never held a batch: nothing was tested"
    recovered = [finished[i][0] - killed_at for i in in_flight]
    statuses = collections.Counter(finished[i][1] for i in in_flight)
    print(
        f"in flight at the kill: {len(in_flight)} (frozen worker held {held} batches); "
        f"answered {dict(statuses)} at most {max(recovered):.3f} s after the kill; "
        f"all requests {dict(outcomes)}"
    )
    assert len(finished) == len(started), "a request got no answer"
    assert set(outcomes) == {"OK"}, outcomes
    assert statuses == {"OK": len(in_flight)}
    assert max(recovered) < RECOVERY_BOUND_S
    assert stack.workers[1].running
