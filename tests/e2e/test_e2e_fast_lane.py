"""The fast lane (issue 31) through the whole stack: a lone request on a plain
route goes straight to an idle worker over core NATS; workers without a free
slot refuse and the request takes the batcher and the work queue; a worker
that holds a fast-lane request and is killed loses nothing (the gateway sends
the same request the normal way after ``fast_lane_retry_s``, first answer
kept). docs/architecture.md, "The fast lane"."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_ENV = {
    "INFERBUS_GATEWAY_DIRECT_DISPATCH": "true",
    "INFERBUS_GATEWAY_FAST_LANE": "true",
    "INFERBUS_WORKER_FAST_LANE": "true",
    # Up to 4 in flight at the gateway still try the lane: with 16 senders the two
    # workers' single slots are mostly taken, so refusals happen.
    "INFERBUS_GATEWAY_FAST_LANE_MAX_IN_FLIGHT": "4",
    "INFERBUS_GATEWAY_FAST_LANE_RETRY_S": "0.5",
    # Bundles never wait for more requests, whatever the machine's load: on a busy
    # machine a gateway that collects requests sends bundles of several, which
    # never take the lane, and the refusals below did not happen (a flaky test).
    "INFERBUS_GATEWAY_BUNDLE_BUSY_CPU": "1.5",
}
DEADLINE_S = 5.0


def _gateway(stack, name: str) -> float:
    return sum(v for k, v in stack.metrics(stack.gateway).items() if k.startswith(name))


def _sent(stack) -> float:
    return _gateway(stack, "inferbus_gateway_fast_lane_sent_total")


def _fallbacks(stack) -> float:
    return _gateway(stack, "inferbus_gateway_fast_lane_fallbacks_total")


def _batches(stack) -> float:
    """Micro-batches the batcher published to the work queue."""
    return sum(
        v
        for k, v in stack.metrics(stack.batcher).items()
        if k.startswith("inferbus_batcher_batches_published_total")
    )


async def _run(client, session, x: np.ndarray, outcomes: collections.Counter[str]) -> None:
    inp = grpcaio.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    try:
        result = await asyncio.wait_for(
            client.infer("fraud", [inp], timeout=int(DEADLINE_S * 1e6)), DEADLINE_S + 3
        )
    except TimeoutError:
        outcomes["HANG"] += 1
        return
    except InferenceServerException as exc:
        outcomes[str(exc.status())] += 1
        return
    expected = session.run(None, {"input": x})[0]
    ok = np.allclose(result.as_numpy("probabilities"), expected, rtol=1e-5, atol=1e-6)
    outcomes["OK" if ok else "WRONG"] += 1


async def test_fast_lane_idle_busy_and_a_killed_worker(stack) -> None:
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    rng = np.random.default_rng(7)
    try:
        # 1. Idle workers, one request at a time: every one takes the lane and none
        #    reaches the work queue.
        outcomes: collections.Counter[str] = collections.Counter()
        sent0, fb0, batches0 = _sent(stack), _fallbacks(stack), _batches(stack)
        for _ in range(20):
            await _run(client, session, rng.standard_normal((1, 64)).astype(np.float32), outcomes)
        assert outcomes == {"OK": 20}, outcomes
        assert _sent(stack) - sent0 == 20
        assert _fallbacks(stack) == fb0
        assert _batches(stack) == batches0

        # 2. Busy workers (16 senders, one slot each): some are refused and take the
        #    normal path; every request gets one correct answer.
        outcomes.clear()
        fb0, batches0 = _fallbacks(stack), _batches(stack)

        async def sender(k: int) -> None:
            r = np.random.default_rng(100 + k)
            for _ in range(15):
                await _run(client, session, r.standard_normal((1, 64)).astype(np.float32), outcomes)

        s0 = _sent(stack)
        await asyncio.gather(*(sender(k) for k in range(16)))
        print(
            f"busy workers: {_sent(stack) - s0:.0f} sent on the lane, "
            f"{_fallbacks(stack) - fb0:.0f} refused and sent the normal way"
        )
        assert outcomes == {"OK": 240}, outcomes
        assert _fallbacks(stack) > fb0
        assert _batches(stack) > batches0

        # 3. A worker holding a fast-lane request dies: freeze it (it keeps its
        #    subscription, so the lane picks it about half the time), send requests
        #    one at a time until one is still unanswered 0.1 s after it was sent
        #    (the survivor answers in a few ms: the frozen worker holds it), then
        #    SIGKILL the worker, before the gateway's 0.5 s retry. Every request is
        #    answered once, OK, the held one by the survivor after the retry time.
        victim = stack.workers[0]
        assert victim.pid is not None
        outcomes.clear()
        fb0 = _fallbacks(stack)
        os.kill(victim.pid, signal.SIGSTOP)
        killed_holding = False
        took: list[float] = []
        try:
            for _ in range(30):
                x = rng.standard_normal((1, 64)).astype(np.float32)
                t0 = time.monotonic()
                run = asyncio.ensure_future(_run(client, session, x, outcomes))
                await asyncio.sleep(0.1)
                if not run.done():
                    os.kill(victim.pid, signal.SIGKILL)
                    killed_holding = True
                await run
                took.append(time.monotonic() - t0)
                if killed_holding:
                    break
            for _ in range(6):
                t0 = time.monotonic()
                await _run(
                    client, session, rng.standard_normal((1, 64)).astype(np.float32), outcomes
                )
                took.append(time.monotonic() - t0)
        finally:
            if victim.running:
                os.kill(victim.pid, signal.SIGKILL)
        print(f"outcomes={dict(outcomes)} took={[round(t, 3) for t in took]}")
        assert killed_holding
        assert victim.returncode == -9
        assert outcomes == {"OK": len(took)}, outcomes
        assert _fallbacks(stack) > fb0  # the held request went the normal way
        assert max(took) < 2.5  # the retry time plus the survivor's run, not the deadline
        # The survivor keeps serving on the lane.
        outcomes.clear()
        sent0 = _sent(stack)
        for _ in range(5):
            await _run(client, session, rng.standard_normal((1, 64)).astype(np.float32), outcomes)
        assert outcomes == {"OK": 5}, outcomes
        assert _sent(stack) - sent0 == 5
    finally:
        await client.close()
