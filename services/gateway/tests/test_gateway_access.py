"""The gateway's request scope: one access-log line, stage metrics, refusals, span."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from inferbus_common import tracing
from inferbus_common.errors import ResourceExhausted, Unauthenticated
from inferbus_common.settings import ServiceSettings
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.observation.access import RequestScope
from inferbus_gateway.triton.tracelog import TraceSettings

CLIENT_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing(
        "gateway",
        ServiceSettings(tracing_enabled=True, tracing_sample_ratio=0.0),
        exporter=exporter,
    )
    try:
        yield exporter
    finally:
        tracing.shutdown_tracing()


def _request() -> InferRequest:
    return InferRequest(model="m-access", version="", id="r-1", inputs=[], tenant="acme")


def test_answered_request_logs_one_line_and_feeds_the_stage_histogram(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = _value("inferbus_gateway_stage_seconds_count", model="m-access", stage="bus")
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    with RequestScope("grpc", "m-access", "", True) as scope:
        scope.request = _request()
        scope.response = InferResponse(
            model="m-access",
            version="3",
            id="r-1",
            outputs=[],
            timings_ms={"gateway": 0.2, "queue": 0.5, "compute": 1.0, "total": 2.0},
        )
    (record,) = [r for r in caplog.records if r.name == "inferbus_gateway.access"]
    assert (record.request_id, record.model, record.version, record.tenant, record.status) == (
        "r-1",
        "m-access",
        "3",
        "acme",
        "OK",
    )
    assert record.protocol == "grpc" and record.latency_ms >= 0
    assert not hasattr(record, "trace_id")  # no traceparent, tracing off
    after = _value("inferbus_gateway_stage_seconds_count", model="m-access", stage="bus")
    assert after == before + 1
    assert _value("inferbus_gateway_stage_seconds_sum", model="m-access", stage="compute") > 0


def test_refusals_are_counted_by_reason_and_logged_with_their_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    before = _value("inferbus_gateway_rejections_total", model="m-access", reason="model-qps")
    with pytest.raises(ResourceExhausted), RequestScope("http", "m-access", "", True) as scope:
        scope.request = _request()
        raise ResourceExhausted("slow down", reason="model-qps")
    with pytest.raises(Unauthenticated), RequestScope("http", "m-access", "", True):
        raise Unauthenticated("who are you")
    assert (
        _value("inferbus_gateway_rejections_total", model="m-access", reason="model-qps")
        == before + 1
    )
    assert _value("inferbus_gateway_rejections_total", model="m-access", reason="unauthenticated")
    lines = [r for r in caplog.records if r.name == "inferbus_gateway.access"]
    assert [(r.status, getattr(r, "reason", None)) for r in lines] == [
        ("RESOURCE_EXHAUSTED", "model-qps"),
        ("UNAUTHENTICATED", None),
    ]


def test_access_log_can_be_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    with RequestScope("grpc", "m-access", "", False):
        pass
    assert not [r for r in caplog.records if r.name == "inferbus_gateway.access"]


def test_sampled_request_gets_a_server_span_and_forwards_its_context(
    spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    with RequestScope("grpc", "m-access", CLIENT_TP, True) as scope:
        forwarded = scope.traceparent
        scope.request = _request()
    assert forwarded != CLIENT_TP and tracing.is_sampled(forwarded)
    (span,) = spans.get_finished_spans()
    assert span.name == "inferbus.gateway.infer"
    assert span.parent.span_id == 0x00F067AA0BA902B7
    assert f"{span.context.span_id:016x}" in forwarded
    assert span.attributes["inferbus.tenant"] == "acme"
    (record,) = [r for r in caplog.records if r.name == "inferbus_gateway.access"]
    assert record.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_unsampled_request_forwards_the_client_context_unchanged(
    spans: InMemorySpanExporter,
) -> None:
    unsampled = CLIENT_TP[:-2] + "00"
    with RequestScope("grpc", "m-access", unsampled, False) as scope:
        pass
    assert scope.traceparent == unsampled
    with RequestScope("grpc", "m-access", "", False) as scope:  # ratio 0: never a root
        pass
    assert scope.traceparent == ""
    assert spans.get_finished_spans() == ()


def test_trace_settings_steer_which_requests_are_traced(spans: InMemorySpanExporter) -> None:
    """Triton's trace settings (`tracelog.TraceSettings`) decide at the request scope."""
    trace = TraceSettings(available=True, ratio=0.0)
    with RequestScope("grpc", "m-trace", "", False, trace):
        pass
    assert spans.get_finished_spans() == ()  # ratio 0: no root trace
    trace.update(
        "m-trace", {"trace_level": ["TIMESTAMPS"], "trace_rate": ["1"], "trace_count": ["2"]}
    )
    for _ in range(3):
        with RequestScope("grpc", "m-trace", "", False, trace):
            pass
    assert len(spans.get_finished_spans()) == 2  # trace_count stopped the third
    assert trace.get("m-trace")["trace_count"] == ["0"]
    trace.update("m-trace", {"trace_level": ["OFF"]})
    with RequestScope("grpc", "m-trace", CLIENT_TP, False, trace) as scope:
        pass
    # OFF: not even a client's sampled context starts a gateway span; it passes on unchanged.
    assert scope.traceparent == CLIENT_TP and len(spans.get_finished_spans()) == 2
