"""Open-loop overload against a running stack (issue #11, item 2).

`measure_capacity` finds what the stack serves for a model with a closed loop
of many clients; `run_flood` then offers a fixed rate (open loop: requests
start on schedule whether or not earlier ones finished, as independent users
would send them), samples the resident memory of every service from
``/proc``, and afterwards measures how long it takes until the closed loop
gets its capacity back. The client speaks raw KServe V2 gRPC (the generated
stubs), so it can read the ``inferbus-reason`` trailer of every refusal and
costs less CPU per request than tritonclient.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb
from inferbus_proto.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from inferbus_testing.chaos import ChaosStack, rss_bytes

__all__ = ["FloodReport", "V2Client", "measure_capacity", "run_flood"]

_CLIENT_DEADLINE = "deadline exceeded"


@dataclass(slots=True)
class Answer:
    """One request's outcome: status name (``OK`` or a gRPC code), reason, latency."""

    status: str
    latency_s: float
    reason: str = ""
    message: str = ""


class V2Client:
    """A minimal KServe V2 gRPC client over one channel per gateway."""

    def __init__(self, targets: list[str]) -> None:
        self._channels = [grpc.aio.insecure_channel(t) for t in targets]
        self._stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in self._channels]
        self._next = 0

    async def close(self) -> None:
        """Close every channel."""
        for c in self._channels:
            await c.close()

    async def infer(
        self, model: str, x: np.ndarray, *, deadline_s: float, grace_s: float = 1.0
    ) -> Answer:
        """One FP32 request with a platform deadline; HANG when nothing came by deadline+grace."""
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        req = pb.ModelInferRequest(
            model_name=model,
            id=uuid.uuid4().hex,
            inputs=[
                pb.ModelInferRequest.InferInputTensor(
                    name="input", datatype="FP32", shape=list(x.shape)
                )
            ],
            raw_input_contents=[x.tobytes()],
        )
        req.parameters["timeout"].int64_param = int(deadline_s * 1e6)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(
                stub.ModelInfer(req, timeout=deadline_s + grace_s), deadline_s + grace_s + 0.5
            )
        except TimeoutError:
            return Answer("HANG", time.monotonic() - t0, message="client-side timeout")
        except grpc.aio.AioRpcError as exc:
            latency = time.monotonic() - t0
            details = exc.details() or ""
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and details.lower().startswith(
                _CLIENT_DEADLINE
            ):
                return Answer("HANG", latency, message=details)
            trailers = dict(exc.trailing_metadata() or ())
            reason = str(trailers.get("inferbus-reason", ""))
            return Answer(exc.code().name, latency, reason, details)
        return Answer("OK", time.monotonic() - t0)


async def measure_capacity(
    stack: ChaosStack, model: str, *, seconds: float = 2.0, concurrency: int = 16
) -> float:
    """Correct answers per second of a closed loop of `concurrency` clients."""
    client = V2Client(stack.grpc_urls)
    x = np.zeros((1, 64), np.float32)
    ok = 0
    stop_at = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal ok
        while time.monotonic() < stop_at:
            answer = await client.infer(model, x, deadline_s=5.0)
            ok += answer.status == "OK"

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    finally:
        await client.close()
    return ok / (time.monotonic() - t0)


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else 0.0


@dataclass
class FloodReport:
    """What an open-loop flood did."""

    model: str
    capacity_rps: float
    offered_rps: float
    achieved_rps: float
    seconds: float
    deadline_s: float
    sent: int
    statuses: dict[str, int]
    ok_p50_s: float
    ok_p99_s: float
    reject_p50_s: float
    reject_p99_s: float
    refusals_without_reason: int
    reasons: dict[str, int]
    rss_growth_mib: dict[str, float]
    rss_max_mib: dict[str, float]
    recovery_s: float | None
    samples: list[str] = field(default_factory=list)

    @property
    def hung(self) -> int:
        """Requests that got nothing by deadline + grace."""
        return self.statuses.get("HANG", 0)

    @property
    def lost(self) -> int:
        """Requests with no outcome recorded at all (always 0 unless the harness broke)."""
        return self.sent - sum(self.statuses.values())

    @property
    def rss_growth_max_mib(self) -> float:
        """Largest growth of any one service's RSS during the flood."""
        return max(self.rss_growth_mib.values(), default=0.0)

    def row(self) -> dict[str, Any]:
        """A flat dict for JSON and the report."""
        return {
            "model": self.model,
            "capacity_rps": round(self.capacity_rps, 1),
            "offered_rps": round(self.offered_rps, 1),
            "achieved_rps": round(self.achieved_rps, 1),
            "seconds": self.seconds,
            "deadline_s": self.deadline_s,
            "sent": self.sent,
            "statuses": self.statuses,
            "ok_p50_ms": round(self.ok_p50_s * 1000, 1),
            "ok_p99_ms": round(self.ok_p99_s * 1000, 1),
            "reject_p50_ms": round(self.reject_p50_s * 1000, 1),
            "reject_p99_ms": round(self.reject_p99_s * 1000, 1),
            "reasons": self.reasons,
            "refusals_without_reason": self.refusals_without_reason,
            "lost": self.lost,
            "hung": self.hung,
            "rss_growth_mib": self.rss_growth_mib,
            "rss_max_mib": self.rss_max_mib,
            "recovery_s": self.recovery_s,
        }


async def run_flood(
    stack: ChaosStack,
    model: str,
    *,
    rate: float,
    seconds: float,
    deadline_s: float = 2.0,
    capacity_rps: float | None = None,
    recovery_max_s: float = 20.0,
) -> FloodReport:
    """Offer `rate` requests per second for `seconds`, then time the way back.

    Recovery: from the end of the flood, 0.5 s closed-loop probes until one
    reaches 70 % of `capacity_rps` (measured now when not given) with every
    answer correct. None when that does not happen within `recovery_max_s`.
    """
    if capacity_rps is None:
        capacity_rps = rate
    client = V2Client(stack.grpc_urls)
    x = np.zeros((1, 64), np.float32)
    answers: list[Answer] = []
    pids = stack.pids()
    if stack.nats is not None and stack.nats.pid is not None:
        pids["nats"] = stack.nats.pid
    rss_before = {name: rss_bytes(pid) for name, pid in pids.items()}
    rss_max = dict(rss_before)
    sampling = asyncio.Event()

    async def sample_rss() -> None:
        while not sampling.is_set():
            for name, pid in pids.items():
                rss_max[name] = max(rss_max[name], rss_bytes(pid))
            await asyncio.sleep(0.2)

    async def one() -> None:
        answers.append(await client.infer(model, x, deadline_s=deadline_s))

    sampler = asyncio.create_task(sample_rss())
    tasks: list[asyncio.Task[None]] = []
    n = int(rate * seconds)
    t0 = time.monotonic()
    try:
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        t_sent = time.monotonic()
        await asyncio.gather(*tasks)
    finally:
        sampling.set()
        await sampler
        await client.close()
    t_flood_end = time.monotonic()

    recovery: float | None = None
    while time.monotonic() - t_flood_end < recovery_max_s:
        got = await _probe(stack, model, seconds=0.5)
        if got is not None and got >= 0.7 * capacity_rps:
            recovery = round(time.monotonic() - t_flood_end, 2)
            break

    statuses = collections.Counter(a.status for a in answers)
    ok = [a.latency_s for a in answers if a.status == "OK"]
    rejected = [a for a in answers if a.status == "RESOURCE_EXHAUSTED"]
    mib = 1 / (1024 * 1024)
    return FloodReport(
        model=model,
        capacity_rps=capacity_rps,
        offered_rps=rate,
        achieved_rps=n / max(1e-9, t_sent - t0),
        seconds=seconds,
        deadline_s=deadline_s,
        sent=n,
        statuses=dict(statuses),
        ok_p50_s=_quantile(ok, 0.5),
        ok_p99_s=_quantile(ok, 0.99),
        reject_p50_s=_quantile([a.latency_s for a in rejected], 0.5),
        reject_p99_s=_quantile([a.latency_s for a in rejected], 0.99),
        refusals_without_reason=sum(1 for a in rejected if not a.reason),
        reasons=dict(collections.Counter(a.reason for a in rejected)),
        rss_growth_mib={k: round((rss_max[k] - rss_before[k]) * mib, 1) for k in pids},
        rss_max_mib={k: round(rss_max[k] * mib, 1) for k in pids},
        recovery_s=recovery,
        samples=sorted({f"{a.status} [{a.reason}]: {a.message[:160]}" for a in answers})[:12],
    )


async def _probe(stack: ChaosStack, model: str, *, seconds: float) -> float | None:
    """Closed-loop rate over `seconds`; None when any answer was not correct."""
    client = V2Client(stack.grpc_urls)
    x = np.zeros((1, 64), np.float32)
    ok = bad = 0
    stop_at = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal ok, bad
        while time.monotonic() < stop_at:
            answer = await client.infer(model, x, deadline_s=2.0)
            if answer.status == "OK":
                ok += 1
            else:
                bad += 1

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(loop() for _ in range(16)))
    finally:
        await client.close()
    return None if bad else ok / (time.monotonic() - t0)
