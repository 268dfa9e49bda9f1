"""Overload: offered load far above capacity is refused early and clearly,
accepted requests end by their deadline, and service recovers afterwards.

Capacity is taken away by freezing both workers (SIGSTOP), and the work queue
of the model is bounded to a few micro-batches, so the bound is reached within
one burst."""

from __future__ import annotations

import asyncio
import collections
import signal
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_ENV = {"INFERBUS_BATCHER_STREAM_MAX_MSGS_PER_SUBJECT": "4"}
DEADLINE_S = 2.0


async def test_overload_is_refused_fast_and_bounded_then_recovers(stack) -> None:
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    x = np.zeros((1, 64), np.float32)
    outcomes: collections.Counter[str] = collections.Counter()
    latencies: dict[str, list[float]] = collections.defaultdict(list)

    async def one() -> None:
        inp = grpcaio.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(
                client.infer("fraud", [inp], timeout=int(DEADLINE_S * 1e6)), DEADLINE_S + 3
            )
            status = "OK"
        except TimeoutError:
            status = "HANG"
        except InferenceServerException as exc:
            status = exc.status().removeprefix("StatusCode.")
            if status == "RESOURCE_EXHAUSTED":
                assert "work queue" in exc.message() or "queue" in exc.message()
        outcomes[status] += 1
        latencies[status].append(time.monotonic() - t0)

    for w in stack.workers:
        w.send_signal(signal.SIGSTOP)
    try:
        await asyncio.gather(*(one() for _ in range(300)))
    finally:
        for w in stack.workers:
            w.send_signal(signal.SIGCONT)
    print(dict(outcomes), {k: round(max(v), 3) for k, v in latencies.items()})
    assert outcomes["HANG"] == 0
    assert set(outcomes) <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, outcomes
    assert outcomes["RESOURCE_EXHAUSTED"] >= 50
    # Refusals come at once, not after waiting.
    assert np.median(latencies["RESOURCE_EXHAUSTED"]) < 1.0
    # Accepted requests end by their deadline (plus scheduling slack), never later.
    assert max(latencies["DEADLINE_EXCEEDED"]) < DEADLINE_S + 1.5

    # Capacity is back: the backlog expires without computing and new traffic is served.
    deadline = time.monotonic() + 20
    ok = 0
    while ok < 20:
        assert time.monotonic() < deadline, f"only {ok} requests served after recovery"
        inp = grpcaio.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        try:
            await client.infer("fraud", [inp], timeout=2_000_000)
            ok += 1
        except InferenceServerException:
            await asyncio.sleep(0.1)
    await client.close()
