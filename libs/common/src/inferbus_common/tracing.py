"""Distributed tracing: one W3C trace per request, gateway → router → batcher → worker.

Sampling is decided once at the gateway (parent-based); later hops only look at
the ``traceparent`` flags (`is_sampled`), so an unsampled request builds no
span. `setup_tracing` / `shutdown_tracing` in each service's ``main``; until
then every function is a cheap no-op. See docs/architecture.md ("Traces,
logs and metrics").
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from inferbus_common.settings import ServiceSettings

log = logging.getLogger(__name__)

Exporter = Literal["otlp", "console", "none"]

_SAMPLED_LAST_HEX = frozenset("13579bdfBDF")
_TRACEPARENT_LEN = 55  # "00-" + 32 hex + "-" + 16 hex + "-" + 2 hex

_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
_root_ratio = 0.0
_draw = random.random

__all__ = [
    "Exporter",
    "SpanKind",
    "enabled",
    "end_span",
    "is_sampled",
    "link_to",
    "parse_traceparent",
    "sample_ratio",
    "setup_tracing",
    "shutdown_tracing",
    "start_child_span",
    "start_server_span",
    "trace_id_of",
    "traceparent_of",
]


# --- traceparent strings -----------------------------------------------------------
def is_sampled(traceparent: str) -> bool:
    """Whether a ``traceparent`` asks for the request to be traced (flags bit 0).

    Only the length and the last hex digit are looked at: this runs on every
    request at every hop, and a malformed value is rejected later by
    `parse_traceparent`.
    """
    return len(traceparent) == _TRACEPARENT_LEN and traceparent[-1] in _SAMPLED_LAST_HEX


def parse_traceparent(traceparent: str) -> SpanContext | None:
    """The remote span context a W3C ``traceparent`` names; None when malformed.

    Version ``00`` is the only one defined; the W3C rules for all-zero ids
    and version ``ff`` are applied.
    """
    parts = traceparent.strip().split("-")
    if len(parts) < 4:
        return None
    version, trace_hex, span_hex, flags_hex = parts[:4]
    if (
        len(version) != 2
        or version.lower() == "ff"
        or len(trace_hex) != 32
        or len(span_hex) != 16
        or len(flags_hex) != 2
        or (version == "00" and len(parts) != 4)
    ):
        return None
    try:
        trace_id = int(trace_hex, 16)
        span_id = int(span_hex, 16)
        flags = int(flags_hex, 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def traceparent_of(span: Span) -> str:
    """The ``traceparent`` that makes the next hop's span a child of `span`."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id_of(traceparent: str) -> str:
    """The 32-hex-digit trace id inside a ``traceparent`` (empty when there is none)."""
    if len(traceparent) == _TRACEPARENT_LEN and traceparent[2] == "-":
        return traceparent[3:35]
    return ""


# --- set-up ------------------------------------------------------------------------
def enabled() -> bool:
    """Whether this process records spans at all."""
    return _tracer is not None


def _exporter(kind: Exporter, endpoint: str) -> SpanExporter | None:
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    return None


def setup_tracing(
    service: str,
    settings: ServiceSettings,
    instance: str = "",
    *,
    exporter: SpanExporter | None = None,
) -> None:
    """Create this process's tracer from its settings (no-op when tracing is off).

    Args:
        service: short service name (``gateway``, ``router`` ...); spans carry
            ``service.name = inferbus-<service>``.
        settings: the service's settings (``tracing_*`` fields).
        instance: ``service.instance.id`` of the spans.
        exporter: an exporter to use instead of the configured one (tests use
            OpenTelemetry's in-memory exporter).
    """
    global _provider, _tracer, _root_ratio
    if not settings.tracing_enabled:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    from inferbus_common import __version__

    attributes = {"service.name": f"inferbus-{service}", "service.version": __version__}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(
        resource=Resource.create(attributes),
        # Roots are drawn in start_server_span (before any object is built).
        sampler=ParentBased(ALWAYS_ON),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        configured = _exporter(settings.tracing_exporter, settings.tracing_otlp_endpoint)
        if configured is not None:
            provider.add_span_processor(
                BatchSpanProcessor(
                    configured,
                    max_queue_size=settings.tracing_max_queue,
                    schedule_delay_millis=settings.tracing_export_interval_ms,
                )
            )
    _provider = provider
    _root_ratio = settings.tracing_sample_ratio
    _tracer = provider.get_tracer("inferbus")
    log.info(
        "tracing on: sample ratio %s, exporter %s",
        settings.tracing_sample_ratio,
        "in-process" if exporter is not None else settings.tracing_exporter,
    )


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Export what is buffered and stop the tracer (idempotent)."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


# --- spans -------------------------------------------------------------------------
def _context_of(parent: SpanContext | None) -> otel_context.Context | None:
    if parent is None:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def sample_ratio() -> float:
    """The configured share of requests without a client decision that start a trace."""
    return _root_ratio


def start_server_span(
    name: str,
    traceparent: str,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    *,
    ratio: float | None = None,
) -> Span | None:
    """The span of a request entering the platform, or None when it is not sampled.

    Parent-based: the client's valid ``traceparent`` decides (traced when its
    sampled flag is set, never otherwise); without one (or with a malformed
    one) a new trace starts at the configured ratio (`ratio`, when given,
    replaces it: the gateway's trace settings). Give `attributes` only when
    they are free to build; set costly ones after checking for None.
    """
    tracer = _tracer
    if tracer is None:
        return None
    parent = parse_traceparent(traceparent) if traceparent else None
    if parent is None:
        if _draw() >= (_root_ratio if ratio is None else ratio):
            return None
    elif not parent.trace_flags.sampled:
        return None  # the caller decided against tracing
    span = tracer.start_span(
        name, context=_context_of(parent), kind=SpanKind.SERVER, attributes=attributes
    )
    return span if span.is_recording() else None


def start_child_span(
    name: str,
    traceparent: str,
    *,
    kind: SpanKind = SpanKind.CONSUMER,
    attributes: Mapping[str, str | int | float | bool] | None = None,
    links: Iterable[Link] = (),
    start_time_ns: int | None = None,
) -> Span | None:
    """A span continuing a sampled ``traceparent``; None when tracing is off or
    the request is not sampled (then nothing is built)."""
    tracer = _tracer
    if tracer is None or not is_sampled(traceparent):
        return None
    parent = parse_traceparent(traceparent)
    if parent is None:
        return None
    return tracer.start_span(
        name,
        context=_context_of(parent),
        kind=kind,
        attributes=attributes,
        links=list(links),
        start_time=start_time_ns,
    )


def link_to(traceparent: str) -> Link | None:
    """A span link to the span a sampled ``traceparent`` names (None otherwise)."""
    if not is_sampled(traceparent):
        return None
    parent = parse_traceparent(traceparent)
    return Link(parent) if parent is not None else None


def end_span(span: Span | None, status: str = "OK", message: str = "") -> None:
    """End a span with the request's outcome (a `StatusCode` name, ``OK`` or ``DEGRADED``).

    Errors mark the span ERROR with `message`; the outcome is also kept as the
    ``inferbus.status`` attribute so traces can be searched by it.
    """
    if span is None:
        return
    span.set_attribute("inferbus.status", status)
    if status not in ("OK", "DEGRADED"):
        span.set_status(Status(StatusCode.ERROR, message or status))
    span.end()
