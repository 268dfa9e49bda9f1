"""The edge of one inference request: its server span and its access-log line.

Both protocols wrap `InferenceService.infer` in a `RequestScope`, so every
inference request gets, whatever its outcome:

* a ``inferbus.gateway.infer`` SERVER span when it is sampled (see
  `inferbus_common.tracing`), whose context is what the request carries into
  the platform;
* one JSON access-log line at INFO (logger ``inferbus_gateway.access``) with
  ``request_id``, ``trace_id``, ``model``, ``version``, ``tenant``,
  ``latency_ms``, ``status`` (``OK``, ``DEGRADED`` or a `StatusCode` name),
  ``protocol`` and, for refusals, ``reason``.

Only those fields are logged: never headers (API keys, bearer tokens), never
tensors. ``INFERBUS_GATEWAY_ACCESS_LOG=false`` turns the line off.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from inferbus_common import tracing
from inferbus_common.errors import InferbusError, ResourceExhausted
from inferbus_common.logs import BufferedLines
from inferbus_common.loopmetrics import LoopGauge, LoopHistogram
from inferbus_gateway.admission import BreakerOpen
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.triton.tracelog import TraceSettings

if TYPE_CHECKING:
    from opentelemetry.trace import Span

access_log = logging.getLogger("inferbus_gateway.access")
ACCESS_LINES = BufferedLines(access_log)
"""The access log's lines, written in batches (`inferbus_common.logs.BufferedLines`)."""

SPAN_NAME = "inferbus.gateway.infer"

STAGE_SECONDS = LoopHistogram(
    "inferbus_gateway_stage_seconds",
    "Where an answered request's time went, by stage: gateway (admission, validation, "
    "encoding), queue (batcher and work queue), compute (engine), pre/post (processing, "
    "when the model has any) and bus (NATS hops: route, dispatch and reply).",
    ["model", "stage"],
    buckets=(
        0.00005,
        0.0001,
        0.00025,
        0.0005,
        0.001,
        0.002,
        0.003,
        0.005,
        0.0075,
        0.01,
        0.02,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        10.0,
    ),
)
IN_FLIGHT = LoopGauge(
    "inferbus_gateway_in_flight_requests",
    "Inference requests the gateway has taken and not answered yet (both protocols).",
)
REJECTIONS = Counter(
    "inferbus_gateway_rejections_total",
    "Requests the gateway refused before they reached a model, by reason "
    "(unauthenticated, permission-denied, breaker-open, or the limit's reason: "
    "cluster-qps, model-qps, tenant-quota, instance-qps, daily/monthly quota ...).",
    ["model", "reason"],
)
_REFUSALS = {
    "UNAUTHENTICATED": "unauthenticated",
    "PERMISSION_DENIED": "permission-denied",
}
_stage_children: dict[tuple[str, str], Any] = {}


def _observe_stages(model: str, timings_ms: dict[str, float]) -> None:
    """Feed a response's stage timings (ms) into `STAGE_SECONDS`; the remainder is ``bus``."""
    total = timings_ms.get("total")
    if total is None:
        return
    rest = total
    for stage, ms in timings_ms.items():
        if stage == "total":
            continue
        rest -= ms
        _stage(model, stage).observe(ms / 1000.0)
    _stage(model, "bus").observe(max(0.0, rest) / 1000.0)


def _stage(model: str, stage: str) -> Any:
    child = _stage_children.get((model, stage))
    if child is None:
        child = _stage_children[(model, stage)] = STAGE_SECONDS.labels(model, stage)
    return child


class RequestScope:
    """Context manager around one inference request at the gateway.

    Args:
        protocol: ``grpc`` or ``http``.
        model: the model the client named (before the request is decoded).
        traceparent: the client's W3C ``traceparent`` ("" when none).
        log_enabled: write the access-log line.
        trace: the gateway's trace settings (Triton's trace extension); None:
            the configured sample ratio.

    Attributes:
        traceparent: what the request carries into the platform: this span's
            context when sampled, else the client's value unchanged.
        request: set by the caller once decoded (for id and tenant).
        response: set by the caller once answered (for version and degraded).
    """

    __slots__ = (
        "_log",
        "_model",
        "_protocol",
        "_span",
        "_t0",
        "_trace",
        "request",
        "response",
        "traceparent",
    )

    def __init__(
        self,
        protocol: str,
        model: str,
        traceparent: str,
        log_enabled: bool,
        trace: TraceSettings | None = None,
    ) -> None:
        self._protocol = protocol
        self._trace = trace
        self._model = model
        self._log = log_enabled
        self.traceparent = traceparent
        self.request: InferRequest | None = None
        self.response: InferResponse | None = None
        self._span: Span | None = None
        self._t0 = 0.0

    def __enter__(self) -> RequestScope:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(exc)

    def start(self) -> RequestScope:
        """Start the clock and, when the request is sampled, its span."""
        self._t0 = time.perf_counter()
        IN_FLIGHT.inc()
        trace = self._trace
        if tracing.enabled() and (trace is None or not trace.off(self._model)):
            ratio = trace.root_ratio(self._model) if trace is not None else None
            span = tracing.start_server_span(SPAN_NAME, self.traceparent, ratio=ratio)
            if span is not None:
                if trace is not None:
                    trace.traced(self._model)
                span.set_attribute("inferbus.model", self._model)
                span.set_attribute("inferbus.protocol", self._protocol)
                self._span = span
                self.traceparent = tracing.traceparent_of(span)
        return self

    def finish(self, exc: BaseException | None) -> None:
        """End the span and write the access-log line; `exc` is what the request raised."""
        latency_ms = (time.perf_counter() - self._t0) * 1000.0
        IN_FLIGHT.dec()
        reason = ""
        message = ""
        if exc is None:
            response = self.response
            status = "DEGRADED" if response is not None and response.degraded else "OK"
            if response is not None and status == "OK":
                _observe_stages(self._model, response.timings_ms)
        elif isinstance(exc, InferbusError):
            status = exc.code.name
            message = exc.message
            if isinstance(exc, ResourceExhausted):
                reason = exc.reason
                REJECTIONS.labels(self._model, reason or "limited").inc()
            elif isinstance(exc, BreakerOpen):
                REJECTIONS.labels(self._model, "breaker-open").inc()
            elif status in _REFUSALS:
                REJECTIONS.labels(self._model, _REFUSALS[status]).inc()
        elif isinstance(exc, Exception):
            status = "INTERNAL"
            message = type(exc).__name__
        else:
            status = "CANCELLED"  # client went away (CancelledError) or shutdown
        request, response = self.request, self.response
        version = response.version if response is not None else (request.version if request else "")
        request_id = response.id if response is not None else (request.id if request else "")
        span = self._span
        if span is not None:
            if version:
                span.set_attribute("inferbus.version", version)
            if request_id:
                span.set_attribute("inferbus.request_id", request_id)
            if request is not None and request.tenant:
                span.set_attribute("inferbus.tenant", request.tenant)
            if reason:
                span.set_attribute("inferbus.reason", reason)
            tracing.end_span(span, status, message)
        if self._log and access_log.isEnabledFor(logging.INFO):
            extra: dict[str, object] = {
                "model": self._model,
                "status": status,
                "latency_ms": round(latency_ms, 3),
                "protocol": self._protocol,
            }
            if request_id:
                extra["request_id"] = request_id
            if version:
                extra["version"] = version
            if request is not None and request.tenant:
                extra["tenant"] = request.tenant
            trace_id = tracing.trace_id_of(self.traceparent)
            if trace_id:
                extra["trace_id"] = trace_id
            if reason:
                extra["reason"] = reason
            ACCESS_LINES.info("infer", extra)
