"""No live worker → UNAVAILABLE within 1 s, saying why (issue 28).

One worker serves the fraud model. It is killed with SIGKILL under steady gRPC
and HTTP traffic; the gateway learns of it from its liveness probe (nats-server
answers "no responders" for the dead worker's subject, `noworker.WorkerWatch`),
not from the heartbeat going stale (15 s). Asserted, measured from the kill:

* the first UNAVAILABLE "no worker" answer comes within `BOUND_S` (1 s)
  of the kill, over gRPC and over HTTP (503); by design it comes after about
  one probe period (0.25 s) plus a round trip, so the bound has margin on a
  loaded machine;
* every request sent later than `BOUND_S` after the kill gets that answer, and
  none waits for its deadline (asserted loosely: under half of it);
* the answer names the model, the version, the dead worker (its pid) and says
  "no worker serves it";
* every request gets an answer: OK (before the kill) or UNAVAILABLE; none
  hangs, none ends DEADLINE_EXCEEDED (those in flight at the kill are answered
  by the gateway's sweep, not at their deadline);
* `inferbus status`'s per-version reason (the gateway's repository index) says
  "no worker" and names the dead worker;
* once a worker starts again, requests succeed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_cli.commands.status import version_reasons
from inferbus_cli.rpc import inference_stub
from inferbus_testing.examples import make_fraud_model
from inferbus_testing.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOUND_S = 1.0
"""From the kill to the first "no worker" answer. Measured: see docs/operations.md."""
DEADLINE_S = 8.0
"""Each request's deadline: far above the bound, so a request that waited for
its deadline shows as a failure of the bound, not as a pass."""
AFTER_KILL_S = 3.0
STACK_ENV: dict[str, str] = {}
"""Environment of every service (the defaults: this is what operators run)."""
SENDERS = 4


@dataclass
class Outcome:
    proto: str
    sent: float
    done: float
    status: str
    message: str


@pytest.fixture(scope="module")
def one_worker_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    base = tmp_path_factory.mktemp("noworker")
    st = LocalStack(base, workers=1, env=dict(STACK_ENV))
    with st:
        model_dir = make_fraud_model(base / "fraud-model")
        st.push(model_dir, "fraud")
        st.wait_model_ready("fraud")
        yield st


def _x(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((1, 64)).astype(np.float32)


async def _grpc_once(client: grpcaio.InferenceServerClient, x: np.ndarray) -> tuple[str, str]:
    inp = grpcaio.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    try:
        await asyncio.wait_for(
            client.infer("fraud", [inp], timeout=int(DEADLINE_S * 1e6)), DEADLINE_S + 5
        )
    except TimeoutError:
        return "HANG", ""
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    return "OK", ""


async def _http_once(http: httpx.AsyncClient, url: str, x: np.ndarray) -> tuple[str, str]:
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                        "data": x.ravel().tolist()}]}  # fmt: skip
    try:
        resp = await asyncio.wait_for(
            http.post(
                f"http://{url}/v2/models/fraud/infer",
                json=body,
                headers={"Inferbus-Timeout-Ms": str(int(DEADLINE_S * 1000))},
            ),
            DEADLINE_S + 5,
        )
    except TimeoutError:
        return "HANG", ""
    if resp.status_code == 200:
        return "OK", ""
    try:
        message = resp.json().get("error", resp.text)
    except json.JSONDecodeError:
        message = resp.text
    return f"HTTP{resp.status_code}", message


async def test_no_live_worker_is_answered_unavailable_within_a_second(
    one_worker_stack: LocalStack,
) -> None:
    st = one_worker_stack
    victim = st.workers[0]
    victim_pid = victim.pid
    client = grpcaio.InferenceServerClient(st.grpc_url)
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(timeout=DEADLINE_S + 10) as http:
            rng = np.random.default_rng(0)
            assert await _grpc_once(client, _x(rng)) == ("OK", "")
            assert await _http_once(http, st.http_url, _x(rng)) == ("OK", "")

            async def sender(k: int, proto: str) -> None:
                rng = np.random.default_rng(k)
                while not stop.is_set():
                    t0 = time.monotonic()
                    if proto == "grpc":
                        status, message = await _grpc_once(client, _x(rng))
                    else:
                        status, message = await _http_once(http, st.http_url, _x(rng))
                    outcomes.append(Outcome(proto, t0, time.monotonic(), status, message))
                    await asyncio.sleep(0.01)

            tasks = [
                asyncio.ensure_future(sender(k, "grpc" if k % 2 == 0 else "http"))
                for k in range(SENDERS)
            ]
            await asyncio.sleep(1.0)
            assert victim.pid is not None
            victim.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            await asyncio.sleep(AFTER_KILL_S)
            stop.set()
            await asyncio.gather(*tasks)

            statuses = {o.status for o in outcomes}
            assert "HANG" not in statuses, "a request hung"
            assert statuses <= {"OK", "StatusCode.UNAVAILABLE", "HTTP503"}, statuses
            refused = [o for o in outcomes if o.status != "OK"]
            for o in refused:
                assert "no worker serves it" in o.message, o.message
                assert "model 'fraud' version '1'" in o.message, o.message
                assert f"pid {victim_pid}" in o.message, o.message
            for proto, unavailable in (("grpc", "StatusCode.UNAVAILABLE"), ("http", "HTTP503")):
                mine = [o for o in outcomes if o.proto == proto]
                first = min(o.done for o in mine if o.status == unavailable)
                assert first - t_kill <= BOUND_S, (proto, first - t_kill)
                late = [o for o in mine if o.sent >= t_kill + BOUND_S]
                assert late, proto
                assert all(o.status == unavailable for o in late), (proto, late[:3])
                # None waited for its deadline (they are answered in milliseconds; the
                # bound is loose on purpose: a starved 2-core machine delays any answer).
                assert max(o.done - o.sent for o in late) < DEADLINE_S / 2, proto
            first_any = min(o.done for o in refused) - t_kill
            after = [o.done - o.sent for o in refused if o.sent >= t_kill + BOUND_S]
            print(
                f"kill → first no-worker answer {first_any * 1000:.0f} ms; "
                f"{len(outcomes)} requests, {len(refused)} refused; slowest refusal of a "
                f"request sent after the bound: {max(after) * 1000:.0f} ms"
            )

            # `inferbus status` says the same, per version (its repository-index read).
            with grpc.insecure_channel(st.grpc_url) as channel:
                reasons = version_reasons(inference_stub(channel))
            reason = reasons[("fraud", "1")]
            assert reason.startswith("UNAVAILABLE: no worker (last served by worker"), reason
            assert f"pid {victim_pid}" in reason and "connection to NATS closed" in reason

            # A worker again: requests succeed.
            st.start_worker("worker-back").wait_ready()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if (await _grpc_once(client, _x(rng)))[0] == "OK":
                    break
                await asyncio.sleep(0.1)
            assert await _grpc_once(client, _x(rng)) == ("OK", "")
            assert await _http_once(http, st.http_url, _x(rng)) == ("OK", "")
    finally:
        stop.set()
        await client.close()
