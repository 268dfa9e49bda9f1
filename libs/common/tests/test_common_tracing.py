"""W3C traceparent handling and span propagation of `inferbus_common.tracing`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferbus_common import tracing
from inferbus_common.settings import ServiceSettings

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (every root sampled), spans kept in memory."""
    exp = InMemorySpanExporter()
    settings = ServiceSettings(tracing_enabled=True, tracing_sample_ratio=1.0)
    tracing.setup_tracing("test", settings, "t1", exporter=exp)
    try:
        yield exp
    finally:
        tracing.shutdown_tracing()


def test_parse_traceparent_accepts_w3c_and_refuses_malformed() -> None:
    ctx = tracing.parse_traceparent(SAMPLED)
    assert ctx is not None
    assert ctx.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert ctx.span_id == 0xB7AD6B7169203331
    assert ctx.trace_flags.sampled and ctx.is_remote
    for bad in (
        "",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",  # not hex
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
    ):
        assert tracing.parse_traceparent(bad) is None, bad


def test_is_sampled_reads_the_flags() -> None:
    assert tracing.is_sampled(SAMPLED)
    assert tracing.is_sampled(SAMPLED[:-2] + "03")  # sampled + random-trace-id (level 2)
    assert not tracing.is_sampled(UNSAMPLED)
    assert not tracing.is_sampled("")
    assert not tracing.is_sampled("garbage-01")
    assert tracing.trace_id_of(SAMPLED) == "0af7651916cd43dd8448eb211c80319c"
    assert tracing.trace_id_of("nope") == ""


def test_everything_is_a_no_op_when_tracing_is_off() -> None:
    assert not tracing.enabled()
    assert tracing.start_server_span("x", SAMPLED) is None
    assert tracing.start_child_span("x", SAMPLED) is None
    tracing.end_span(None, "INTERNAL")  # accepted


def test_setup_without_tracing_enabled_keeps_it_off() -> None:
    tracing.setup_tracing("test", ServiceSettings(), exporter=InMemorySpanExporter())
    assert not tracing.enabled()


def test_hops_form_one_trace_and_the_batch_span_links_each_request(
    exporter: InMemorySpanExporter,
) -> None:
    gateway = tracing.start_server_span("gw", SAMPLED)
    assert gateway is not None
    tp_gw = tracing.traceparent_of(gateway)
    router = tracing.start_child_span("router", tp_gw)
    assert router is not None
    tp_router = tracing.traceparent_of(router)
    queues = [tracing.start_child_span("queue", tp_router) for _ in range(2)]
    assert all(q is not None for q in queues)
    tps = [tracing.traceparent_of(q) for q in queues if q is not None]
    links = [link for tp in tps if (link := tracing.link_to(tp)) is not None]
    batch = tracing.start_child_span("batch", tps[0], kind=tracing.SpanKind.INTERNAL, links=links)
    for span in (batch, *queues, router):
        tracing.end_span(span)
    tracing.end_span(gateway, "RESOURCE_EXHAUSTED", "queue full")

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"gw", "router", "queue", "batch"}
    trace_ids = {s.context.trace_id for s in exporter.get_finished_spans()}
    assert trace_ids == {0x0AF7651916CD43DD8448EB211C80319C}
    assert spans["gw"].parent.span_id == 0xB7AD6B7169203331  # the client's span
    assert spans["router"].parent.span_id == spans["gw"].context.span_id
    assert spans["queue"].parent.span_id == spans["router"].context.span_id
    linked = {link.context.span_id for link in spans["batch"].links}
    assert linked == {q.get_span_context().span_id for q in queues if q is not None}
    assert spans["gw"].status.is_ok is False
    assert spans["gw"].attributes["inferbus.status"] == "RESOURCE_EXHAUSTED"
    assert spans["gw"].resource.attributes["service.name"] == "inferbus-test"


def test_unsampled_requests_build_no_span(exporter: InMemorySpanExporter) -> None:
    assert tracing.start_server_span("gw", UNSAMPLED) is None
    assert tracing.start_child_span("router", UNSAMPLED) is None
    assert tracing.start_child_span("router", "") is None
    assert tracing.link_to(UNSAMPLED) is None
    assert exporter.get_finished_spans() == ()


def test_root_sampling_follows_the_ratio() -> None:
    exp = InMemorySpanExporter()
    tracing.setup_tracing(
        "test", ServiceSettings(tracing_enabled=True, tracing_sample_ratio=0.0), exporter=exp
    )
    try:
        assert all(tracing.start_server_span("gw", "") is None for _ in range(100))
        # A client's sampled decision is followed whatever the ratio.
        span = tracing.start_server_span("gw", SAMPLED)
        assert span is not None
        tracing.end_span(span)
    finally:
        tracing.shutdown_tracing()
    assert len(exp.get_finished_spans()) == 1
