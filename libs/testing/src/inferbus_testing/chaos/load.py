"""Steady closed-loop load: clients that record one `Attempt` per request."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from inferbus_testing.chaos.stack import FEATURES, INPUT, MODEL, OUTPUT

_CHANNEL_ARGS = [
    # Reconnect to a restarted gateway within a fraction of a second, not
    # gRPC's default back-off of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# The client's own gRPC deadline says "Deadline Exceeded"; the gateway's says
# "... got no answer before its deadline". Only the second is the platform's.
_CLIENT_DEADLINE_MESSAGE = "deadline exceeded"


@dataclass(slots=True)
class Attempt:
    """One client request from first send to final outcome (times: monotonic seconds)."""

    start: float
    end: float
    status: str
    tries: int = 1
    message: str = ""


class _Reference:
    """The model run in process by onnxruntime: what a correct answer is."""

    def __init__(self, model_dir: Path) -> None:
        import onnxruntime as ort

        self._session = ort.InferenceSession(
            str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
        )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out: np.ndarray = self._session.run(None, {INPUT: x})[0]
        return out


class ClosedLoad:
    """A few closed-loop clients, each request with its own deadline.

    Args:
        targets: gRPC addresses of the gateways (client k starts at k % n).
        model_dir: the model directory (for the onnxruntime reference).
        concurrency: clients, each with one request in flight.
        deadline_s: each request's deadline, sent as the KServe ``timeout`` parameter.
        grace_s: how long past the deadline an answer may come before it counts as hung.
        retry: retry UNAVAILABLE (safe to retry) on the next gateway within the deadline.
    """

    def __init__(
        self,
        targets: list[str],
        model_dir: Path,
        *,
        concurrency: int = 6,
        deadline_s: float = 2.0,
        grace_s: float = 1.0,
        retry: bool = True,
    ) -> None:
        import tritonclient.grpc.aio as grpcaio

        self._grpcaio = grpcaio
        self._clients = [
            grpcaio.InferenceServerClient(t, channel_args=_CHANNEL_ARGS) for t in targets
        ]
        self._reference = _Reference(model_dir)
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.grace_s = grace_s
        self.retry = retry
        self.attempts: list[Attempt] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self._tasks = [asyncio.create_task(self._client(k)) for k in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Let every client finish its request in flight, then close the channels."""
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks)
            self._tasks = []
        for c in self._clients:
            with contextlib.suppress(Exception):
                await c.close()

    async def _client(self, k: int) -> None:
        rng = np.random.default_rng(k)
        while not self._stop.is_set():
            x = rng.standard_normal((1, FEATURES)).astype(np.float32)
            self.attempts.append(await self.one(k, x))

    async def one(self, k: int, x: np.ndarray) -> Attempt:
        """Send one request (retrying UNAVAILABLE within its deadline) and classify it."""
        from tritonclient.utils import InferenceServerException

        t0 = time.monotonic()
        deadline = t0 + self.deadline_s
        request_id = uuid.uuid4().hex
        tries = 0
        first_error = ""
        n = len(self._clients)
        while True:
            client = self._clients[(k + tries) % n]
            tries += 1
            remaining = deadline - time.monotonic()
            inp = self._grpcaio.InferInput(INPUT, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            try:
                result = await asyncio.wait_for(
                    client.infer(
                        MODEL,
                        [inp],
                        request_id=request_id,
                        timeout=max(1000, int(remaining * 1e6)),
                        client_timeout=remaining + self.grace_s,
                    ),
                    remaining + self.grace_s + 0.5,
                )
            except TimeoutError:
                return Attempt(t0, time.monotonic(), "HANG", tries, "client-side timeout")
            except InferenceServerException as exc:
                status = str(exc.status() or "UNKNOWN").removeprefix("StatusCode.")
                message = exc.message() or ""
                now = time.monotonic()
                if status == "DEADLINE_EXCEEDED" and message.strip().lower().startswith(
                    _CLIENT_DEADLINE_MESSAGE
                ):
                    return Attempt(t0, now, "HANG", tries, message)
                if self.retry and status == "UNAVAILABLE" and deadline - now > 0.05:
                    first_error = first_error or f"retried UNAVAILABLE: {message}"
                    # Safe to retry: not computed. Back off a little, other gateway first.
                    await asyncio.sleep(min(0.05 * tries, max(0.0, deadline - now - 0.05)))
                    continue
                if now > deadline + self.grace_s:
                    return Attempt(t0, now, "HANG", tries, f"late {status}: {message}")
                return Attempt(t0, now, status, tries, message)
            now = time.monotonic()
            if now > deadline + self.grace_s:
                return Attempt(t0, now, "HANG", tries, "late answer")
            got = result.as_numpy(OUTPUT)
            ok = got is not None and np.allclose(got, self._reference(x), rtol=1e-5, atol=1e-6)
            return Attempt(t0, now, "OK" if ok else "WRONG", tries, first_error)


# --- faults -----------------------------------------------------------------------
