"""Opt-in payload capture: sampled requests and their answers, kept in the audit stream.

`PayloadCapture.observe` runs on the request path and only decides (a random
draw, a size check) and queues references to the tensors it already has; a
background task encodes them (`inferbus_common.capture`) and publishes them on
``<prefix>.audit.payload.<model>.<version>``. The queue is bounded: when it is
full, captures are dropped and counted, never waited for. `inferbus replay`
reads the captures back.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence

import nats.errors
from nats.aio.client import Client
from prometheus_client import Counter

from inferbus_common.capture import encode_capture
from inferbus_common.subjects import Subjects
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.observation.sampler import SampledQueue

CAPTURES = Counter(
    "inferbus_gateway_capture_total",
    "Payload captures by result: published, too-large, queue-full, error.",
    ["model", "result"],
)

log = logging.getLogger(__name__)


class PayloadCapture(SampledQueue[tuple[InferRequest, InferResponse, int]]):
    """Samples answered requests into the audit stream.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        rate: fraction (0-1) of answered requests captured.
        models: only these models (empty: every model).
        max_bytes: a request whose inputs and outputs together are larger is
            not captured (keeps the stream and NATS messages bounded).
        queue_size: captures waiting to be published at most.
        draw: random source in [0, 1) (injectable for tests).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        rate: float,
        models: Sequence[str] = (),
        max_bytes: int = 512 * 1024,
        queue_size: int = 1024,
        draw: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(
            rate=rate,
            queue_size=queue_size,
            draw=draw,
            counter=CAPTURES,
            task_name="payload-capture",
        )
        self._nc = nc
        self._subjects = subjects
        self._models = frozenset(models)
        self._max_bytes = max_bytes

    def observe(self, request: InferRequest, response: InferResponse) -> None:
        """Maybe capture one answered request (cheap; never raises for a full queue)."""
        if self._rate <= 0 or response.degraded:
            return
        if self._models and request.model not in self._models:
            return
        if not self._sampled():
            return
        size = sum(t.nbytes for t in request.inputs) + sum(t.nbytes for t in response.outputs)
        if size > self._max_bytes:
            CAPTURES.labels(request.model, "too-large").inc()
            return
        self._enqueue(request.model, (request, response, time.time_ns() // 1_000_000))

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a capture loop outlives any one bad capture
                log.exception("payload capture round failed")
            if self._stop.is_set():
                return

    async def flush(self) -> None:
        """Publish every queued capture now."""
        while self._queue:
            request, response, ts = self._queue.popleft()
            body = encode_capture(
                request_id=response.id,
                model=request.model,
                version=response.version,
                digest=response.digest,
                ts_unix_ms=ts,
                tenant=request.tenant,
                requested_outputs=request.outputs,
                inputs=request.inputs,
                outputs=response.outputs,
            )
            try:
                await self._nc.publish(
                    self._subjects.audit_payload(request.model, response.version), body
                )
            except (nats.errors.Error, OSError, RuntimeError) as exc:
                CAPTURES.labels(request.model, "error").inc()
                log.debug("capture dropped: %s", type(exc).__name__)
                continue
            CAPTURES.labels(request.model, "published").inc()
