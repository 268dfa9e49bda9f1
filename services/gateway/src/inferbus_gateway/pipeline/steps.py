"""The cross-cutting steps around `InferHandler`, each with one job.

`__main__.build_pipeline` lists them in the order a request meets them:

1. `Outcomes`, with its recorders `AuditTrail` (one audit record per
   request, whatever its outcome) and `RequestMetrics`
   (``inferbus_gateway_requests_total`` by status and the latency of answered
   requests); each recorder is a step of its own too.
3. `Observers`: payload capture and drift see each request its model answered.
4. `Fallback`: a load or availability failure answered by the model's
   fallback (fixed outputs or a backup model), marked degraded.
5. `Admit`: authentication, limits, quotas and breakers; the outcome of an
   admitted request goes back to its breaker.
6. `SharedMemory`: inputs read from, outputs written into system shared memory.
7. `Idempotency`: a retried request id joins or replays its first attempt.

Every step but `Fallback` passes errors through unchanged; the status a
client sees is the handler's (or admission's) error.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from inferbus_common.audit import encode_record
from inferbus_common.errors import (
    DeadlineExceeded,
    InferbusError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from inferbus_common.loopmetrics import LoopCounter, LoopHistogram
from inferbus_gateway.admission import Admission, BreakerOpen, fallback_outputs
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.dispatch.idempotency import IdempotencyCache
from inferbus_gateway.dispatch.noworker import NoLiveWorker
from inferbus_gateway.observation.auditbatch import AuditBatches
from inferbus_gateway.pipeline.call import Closable, Handler, InferCall
from inferbus_gateway.pipeline.handler import InferHandler
from inferbus_gateway.triton.sharedmemory import SystemSharedMemory

REQUESTS = LoopCounter(
    "inferbus_gateway_requests_total",
    "Inference requests answered by the gateway.",
    ["model", "version", "protocol", "status"],
)
LATENCY = LoopHistogram(
    "inferbus_gateway_request_duration_seconds",
    "End-to-end latency of inference requests seen by the gateway.",
    ["model", "protocol"],
    buckets=(
        0.0005,
        0.001,
        0.002,
        0.003,
        0.005,
        0.0075,
        0.01,
        0.015,
        0.02,
        0.03,
        0.05,
        0.075,
        0.1,
        0.2,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
    ),
)

log = logging.getLogger(__name__)

Observer = Callable[[InferRequest, InferResponse], None]
"""Sees a request and the answer its model gave (payload capture, drift)."""


class RecorderStep:
    """A recorder (`failed` / `answered`) that is also a step of its own: it answers
    the call through the next step and records the outcome."""

    async def __call__(self, call: InferCall, next_step: Handler) -> InferResponse:
        """Answer `call` and record its outcome."""
        try:
            response = await next_step(call)
        except InferbusError as exc:
            self.failed(call, exc)
            raise
        self.answered(call, response)
        return response

    def failed(self, call: InferCall, exc: InferbusError) -> None:
        """Record a request that ended with `exc`."""
        raise NotImplementedError

    def answered(self, call: InferCall, response: InferResponse) -> None:
        """Record an answered request (by its model, or by a fallback: ``degraded``)."""
        raise NotImplementedError


class AuditTrail(RecorderStep):
    """Queues one audit record per request (`AuditBatches`); never fails the request.

    No round trip: records are published in batches, a few ms later. A request
    that failed before a version was known is recorded with version ''.

    Args:
        batches: collects records and publishes them per model.
        instance: this gateway's id (the record's ``gateway``).
    """

    def __init__(self, batches: AuditBatches, instance: str) -> None:
        self._batches = batches
        self._instance = instance

    def failed(self, call: InferCall, exc: InferbusError) -> None:
        """Record a request that ended with `exc`."""
        self._record(call, exc.code.name, exc.reason if isinstance(exc, ResourceExhausted) else "")

    def answered(self, call: InferCall, response: InferResponse) -> None:
        """Record an answered request (DEGRADED for a fallback answer)."""
        if response.degraded:
            self._record(call, "DEGRADED", response.degraded)
        else:
            call.version, call.digest = response.version, response.digest
            call.timings_ms = response.timings_ms
            self._record(call, "OK", "")

    def _record(self, call: InferCall, status: str, reason: str) -> None:
        request = call.request
        data = encode_record(
            request_id=call.request_id,
            ts_unix_ms=time.time_ns() // 1_000_000,
            gateway=self._instance,
            protocol=call.protocol,
            tenant=request.tenant,
            model=request.model,
            version=call.version,
            digest=call.digest,
            status=status,
            reason=reason,
            latency_ms=(time.perf_counter() - call.t0) * 1000.0,
            stages_ms=call.timings_ms,
        )
        self._batches.add(request.model, data)

    async def close(self) -> None:
        """Publish the records still collected (call before the NATS connection drains)."""
        await self._batches.close()


class RequestMetrics(RecorderStep):
    """Counts every request by model, version, protocol and status; times answered ones."""

    def __init__(self) -> None:
        self._answered: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def failed(self, call: InferCall, exc: InferbusError) -> None:
        """Count a request that ended with `exc` under its status."""
        REQUESTS.labels(call.request.model, call.version, call.protocol, exc.code.name).inc()

    def answered(self, call: InferCall, response: InferResponse) -> None:
        """Count an answered request (DEGRADED for a fallback answer) and time it."""
        model = call.request.model
        if response.degraded:
            REQUESTS.labels(model, response.version, call.protocol, "DEGRADED").inc()
        else:
            answered, latency = self._answered_metrics(model, response.version, call.protocol)
            answered.inc()
            latency.observe(time.perf_counter() - call.t0)

    def _answered_metrics(self, model: str, version: str, protocol: str) -> tuple[Any, Any]:
        """`REQUESTS` (status OK) and `LATENCY` children of a model version, made once.

        ``labels(...)`` builds and looks up its key on every call; an answered
        request needs both, so their children are kept (one entry per model
        version and protocol, like the metrics' own label sets).
        """
        key = (model, version, protocol)
        children = self._answered.get(key)
        if children is None:
            children = self._answered[key] = (
                REQUESTS.labels(model, version, protocol, "OK"),
                LATENCY.labels(model, protocol),
            )
        return children


class Recorder(Protocol):
    """Sees every request's outcome, never fails it (`AuditTrail`, `RequestMetrics`)."""

    def failed(self, call: InferCall, exc: InferbusError) -> None:
        """A request that ended with `exc`."""
        ...

    def answered(self, call: InferCall, response: InferResponse) -> None:
        """A request answered (by its model, or by a fallback: ``degraded``)."""
        ...


class Outcomes:
    """Hands every request's outcome to recorders, in one layer: each recorder is a
    step of its own as well, but as recorders of one `Outcomes` a request crosses
    one frame for all of them, not one each (`build_pipeline`).

    Args:
        recorders: see each outcome, in this order.
    """

    def __init__(self, recorders: Sequence[Recorder]) -> None:
        self.recorders = tuple(recorders)

    async def __call__(self, call: InferCall, next_step: Handler) -> InferResponse:
        """Answer `call` and show its outcome to every recorder."""
        try:
            response = await next_step(call)
        except InferbusError as exc:
            for recorder in self.recorders:
                recorder.failed(call, exc)
            raise
        for recorder in self.recorders:
            recorder.answered(call, response)
        return response

    async def close(self) -> None:
        """Finish what the recorders hold (the audit records still collected)."""
        for recorder in self.recorders:
            if isinstance(recorder, Closable):
                await recorder.close()


class Observers:
    """Hands each request its model answered to the observers; they never fail it.

    Args:
        observers: called with the request and its answer (not for fallback answers).
    """

    def __init__(self, observers: Sequence[Observer]) -> None:
        self._observers = tuple(observers)

    async def __call__(self, call: InferCall, next_step: Handler) -> InferResponse:
        """Answer `call`, then show a model's answer to every observer."""
        response = await next_step(call)
        if not response.degraded:
            for observe in self._observers:
                try:
                    observe(call.request, response)
                except Exception as exc:  # observation never fails a request
                    log.warning("request observer failed: %s", exc)
        return response


class Fallback:
    """Answers a load or availability failure with the model's fallback, marked `degraded`.

    A fixed answer (``fallback.outputs``) is built here; a backup model
    (``fallback.model``) is asked once through `handler`, without admission
    and without its own fallback.

    Args:
        handler: resolves versions and answers the backup model's request.
    """

    def __init__(self, handler: InferHandler) -> None:
        self._handler = handler

    async def __call__(self, call: InferCall, next_step: Handler) -> InferResponse:
        """Answer `call`; on a failure the fallback covers, its fallback answer."""
        try:
            return await next_step(call)
        except InferbusError as exc:
            answer = await self.answer(call, exc)
            if answer is None:
                raise
            return answer

    async def answer(self, call: InferCall, exc: InferbusError) -> InferResponse | None:
        """The model's fallback answer for `exc`; None when there is none or it failed too."""
        if isinstance(exc, BreakerOpen):
            reason = "breaker-open"
        elif isinstance(exc, ResourceExhausted):
            reason = exc.reason or "limited"
        elif isinstance(exc, DeadlineExceeded):
            reason = "deadline"
        elif isinstance(exc, NoLiveWorker):
            reason = "no-worker"
        elif isinstance(exc, Unavailable):
            reason = "unavailable"
        else:
            return None
        request = call.request
        try:
            dv = self._handler.resolve(request.model, request.version)
        except InferbusError:
            return None
        fb = dv.config.fallback
        if fb is not None and fb.model:
            if reason == "deadline":
                return None  # no time left to ask another model
            backup = InferRequest(
                model=fb.model,
                version=fb.version or "",
                id=request.id,
                inputs=request.inputs,
                outputs=request.outputs,
                priority=request.priority,
                timeout_s=request.timeout_s,
                traceparent=request.traceparent,
                tenant=request.tenant,
            )
            try:
                answer = await self._handler(InferCall.start(backup, call.protocol))
            except InferbusError:
                return None
            answer.model = request.model
            answer.degraded = f"{reason}; answered by {fb.model} version {answer.version}"
            return answer
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        outputs = fallback_outputs(dv.config, rows, request.outputs)
        if outputs is None:
            return None
        return InferResponse(
            model=request.model,
            version=dv.version,
            id=request.id,
            outputs=outputs,
            timings_ms={"total": (time.perf_counter() - call.t0) * 1000.0},
            digest=dv.digest,
            degraded=reason,
        )


class Admit:
    """Admits a request (authentication, limits, quotas, breakers) and reports its
    outcome to the model's breaker.

    Args:
        admission: the gateway's admission control.
    """

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def __call__(self, call: InferCall, next_step: Handler) -> InferResponse:
        """Admit `call` (its tenant is the caller's), answer it, record the outcome.

        Raises:
            Unauthenticated, PermissionDenied, BreakerOpen, ResourceExhausted,
            Unavailable: refused (`Admission.admit`).
        """
        request = call.request
        admission = self._admission
        principal = await admission.admit(call.headers, model=request.model, interface="ModelInfer")
        request.tenant = principal.tenant
        try:
            response = await next_step(call)
        except BaseException as exc:
            admission.record(request.model, exc)  # exactly once per admitted request
            raise
        admission.record(request.model, None)
        return response


class SharedMemory:
    """Reads inputs from and writes outputs into Triton's system shared memory.

    Args:
        regions: the registered regions (None: requests naming a region are refused).
    """

    def __init__(self, regions: SystemSharedMemory | None) -> None:
        self._regions = regions

    def __call__(self, call: InferCall, next_step: Handler) -> Awaitable[InferResponse]:
        """Fill inputs that name a region, answer, place the outputs asked into regions.

        A request that names no region goes straight on (no coroutine of this step's own).

        Raises:
            InvalidArgument: an unknown region, a span outside it, sizes that do
                not fit, or no shared memory served by this gateway.
        """
        request = call.request
        if not (request.shm_inputs or request.shm_outputs):
            return next_step(call)
        return self._answer(call, next_step)

    async def _answer(self, call: InferCall, next_step: Handler) -> InferResponse:
        request = call.request
        if request.shm_inputs:
            self._store().read_inputs(request, request.tenant)
        response = await next_step(call)
        if request.shm_outputs:
            response = self._store().write_outputs(request, response, request.tenant)
        return response

    def _store(self) -> SystemSharedMemory:
        if self._regions is None:
            raise InvalidArgument("system shared memory is not served by this gateway")
        return self._regions


class Idempotency:
    """A retried request (same id and inputs) joins its first attempt or replays its answer.

    Args:
        cache: in-flight attempts and recent answers.
    """

    def __init__(self, cache: IdempotencyCache) -> None:
        self._cache = cache

    def __call__(self, call: InferCall, next_step: Handler) -> Awaitable[InferResponse]:
        """Answer `call` once per id and inputs within the cache's window."""
        if not call.request.id:
            return next_step(call)  # nothing to join or replay (the cache's own rule)
        return self._cache.run(call.request, functools.partial(next_step, call))
