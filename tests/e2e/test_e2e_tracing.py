"""Tracing and logs on a real stack: one trace per request through all four
services, and access logs that carry ids but never secrets or tensors.

Every service exports spans over OTLP/gRPC to a tiny collector run by this
module (a real gRPC server implementing OpenTelemetry's ``TraceService`` with
the protobuf classes that ship with the exporter), every request is sampled
(ratio 1.0), and the gateway requires API keys (real redis-server).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.keys import AdmissionKeys

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVICES = ("GATEWAY", "ROUTER", "BATCHER", "WORKER")
STACK_REDIS = True
# Every request goes through the router here, so a trace spans all four services
# (direct dispatch, on by default, would skip the router on this plain route).
STACK_ENV: dict[str, str] = {
    "INFERBUS_GATEWAY_AUTH_ENABLED": "true",
    "INFERBUS_GATEWAY_DIRECT_DISPATCH": "false",
}
for _svc in SERVICES:
    STACK_ENV |= {
        f"INFERBUS_{_svc}_TRACING_ENABLED": "true",
        f"INFERBUS_{_svc}_TRACING_SAMPLE_RATIO": "1.0",
        f"INFERBUS_{_svc}_TRACING_EXPORT_INTERVAL_MS": "50",
    }

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
# A value no log line could contain by chance: its decimal and byte forms are grepped for.
MARKER = np.float32(12345.678)


@dataclass(frozen=True)
class Span:
    """What the tests look at in an exported span."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    links: tuple[tuple[str, str], ...]
    attributes: dict[str, object]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping every span in memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []

    def Export(self, request, context):
        """Store the spans of one export call."""
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            links=tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links),
                            attributes={
                                a.key: a.value.string_value or a.value.int_value
                                for a in s.attributes
                            },
                        )
                    )
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        """The spans received so far."""
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate, timeout: float = 20.0) -> list[Span]:
        """Poll until `predicate(spans)` holds; return the spans."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                seen = Counter((s.service, s.name) for s in spans)
                raise AssertionError(f"spans not as expected after {timeout}s; got {seen}")
            time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def collector() -> Iterator[Collector]:
    """The in-test OTLP collector; its address goes into STACK_ENV before the stack starts."""
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for svc in SERVICES:
        STACK_ENV[f"INFERBUS_{svc}_TRACING_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def api_key(stack) -> str:
    """An API key of tenant ``acme`` allowed to call ``fraud``."""

    async def create() -> str:
        client = aioredis.from_url(stack.redis.url)
        try:
            store = KeyStore(client, AdmissionKeys("ib"))
            _, secret = await store.create_key("acme")
            await store.allow_models("acme", "fraud")
            return secret
        finally:
            await client.aclose()

    return asyncio.run(create())


def _inputs(rows: int = 1) -> tuple[np.ndarray, grpcclient.InferInput]:
    x = np.full((rows, 64), MARKER, dtype=np.float32)
    inp = grpcclient.InferInput("input", [rows, 64], "FP32")
    inp.set_data_from_numpy(x)
    return x, inp


def _trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id]


def _complete(trace: list[Span]) -> bool:
    names = {s.name for s in trace}
    return {
        "inferbus.gateway.infer",
        "inferbus.router.route",
        "inferbus.batcher.queue",
        "inferbus.worker.request",
        "inferbus.worker.batch",
    } <= names


def test_one_trace_spans_all_four_services_correctly_parented(
    stack, collector: Collector, api_key: str
) -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        _, inp = _inputs()
        result = client.infer(
            "fraud", [inp], headers={"x-api-key": api_key, "traceparent": traceparent}
        )
        assert result.as_numpy("probabilities").shape[0] == 1
    finally:
        client.close()

    spans = collector.wait_for(lambda s: _complete(_trace(s, CLIENT_TRACE)))
    trace = _trace(spans, CLIENT_TRACE)
    by_name = {s.name: s for s in trace}
    assert len(trace) == 5, sorted((s.service, s.name) for s in trace)
    gw = by_name["inferbus.gateway.infer"]
    router = by_name["inferbus.router.route"]
    queue = by_name["inferbus.batcher.queue"]
    request = by_name["inferbus.worker.request"]
    batch = by_name["inferbus.worker.batch"]
    assert {s.service for s in trace} == {
        "inferbus-gateway",
        "inferbus-router",
        "inferbus-batcher",
        "inferbus-worker",
    }
    assert (gw.service, router.service, queue.service, request.service, batch.service) == (
        "inferbus-gateway",
        "inferbus-router",
        "inferbus-batcher",
        "inferbus-worker",
        "inferbus-worker",
    )
    # Parenting: client → gateway → router → batcher → worker (request and batch).
    assert gw.parent_id == CLIENT_SPAN
    assert router.parent_id == gw.span_id
    assert queue.parent_id == router.span_id
    assert request.parent_id == queue.span_id
    assert batch.parent_id == queue.span_id
    # The batch span links to the request span it contains.
    assert (CLIENT_TRACE, queue.span_id) in batch.links
    assert gw.attributes["inferbus.status"] == "OK"
    assert gw.attributes["inferbus.tenant"] == "acme"
    assert gw.attributes["inferbus.version"] == "1"


def test_rest_request_without_traceparent_starts_a_trace(
    stack, collector: Collector, api_key: str
) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
    resp = httpx.post(
        f"http://{stack.http_url}/v2/models/fraud/infer",
        json=body,
        headers={"authorization": f"Bearer {api_key}"},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    rid = resp.json()["id"]

    def found(spans: list[Span]) -> bool:
        roots = [
            s
            for s in spans
            if s.name == "inferbus.gateway.infer" and s.attributes.get("inferbus.request_id") == rid
        ]
        return len(roots) == 1 and _complete(_trace(spans, roots[0].trace_id))

    spans = collector.wait_for(found)
    (root,) = [
        s
        for s in spans
        if s.name == "inferbus.gateway.infer" and s.attributes.get("inferbus.request_id") == rid
    ]
    assert root.parent_id == ""  # a new trace: the client sent no traceparent
    assert root.attributes["inferbus.protocol"] == "http"


def test_batch_span_links_every_request_it_computed(
    stack, collector: Collector, api_key: str
) -> None:
    """Concurrent requests share micro-batches: each worker batch span links exactly
    the batcher spans of the requests it computed, and every request is linked once."""
    tids = [f"{i:032x}" for i in range(0xA0000001, 0xA0000001 + 24)]

    async def burst() -> None:
        import tritonclient.grpc.aio as grpcaio

        client = grpcaio.InferenceServerClient(stack.grpc_url)
        try:
            _, inp = _inputs()
            await asyncio.gather(
                *(
                    client.infer(
                        "fraud",
                        [inp],
                        headers={"x-api-key": api_key, "traceparent": f"00-{t}-{CLIENT_SPAN}-01"},
                    )
                    for t in tids
                )
            )
        finally:
            await client.close()

    asyncio.run(burst())

    def every_request_linked(spans: list[Span]) -> bool:
        linked = {t for s in spans if s.name == "inferbus.worker.batch" for t, _ in s.links}
        done = {s.trace_id for s in spans if s.name == "inferbus.worker.request"}
        # Each service exports on its own schedule: wait for the batcher's spans too.
        queued = {s.trace_id for s in spans if s.name.endswith("queue")}
        return set(tids) <= linked and set(tids) <= done and set(tids) <= queued

    spans = collector.wait_for(every_request_linked)
    queue_spans = {
        (s.trace_id, s.span_id) for s in spans if s.trace_id in tids and s.name.endswith("queue")
    }
    assert len(queue_spans) == len(tids)
    batches = [
        s for s in spans if s.name == "inferbus.worker.batch" and any(t in tids for t, _ in s.links)
    ]
    linked = [link for b in batches for link in b.links]
    assert sorted(linked) == sorted(queue_spans)  # each request linked by exactly one batch
    for b in batches:
        assert (b.trace_id, b.parent_id) in b.links  # parent is one of its requests
        assert b.attributes["inferbus.batch_requests"] >= len(b.links)


def _log_lines(stack) -> list[tuple[str, str]]:
    """(service, line) for every line every service logged."""
    return [
        (name, line)
        for name, proc in stack.procs.items()
        for line in proc.log_path.read_text(errors="replace").splitlines()
    ]


def test_access_log_lines_have_the_fields_and_no_secret_or_payload(
    stack, collector: Collector, api_key: str
) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    x, inp = _inputs(2)
    try:
        client.infer(
            "fraud",
            [inp],
            request_id="access-grpc-1",
            headers={"authorization": f"Bearer {api_key}"},
        )
        with pytest.raises(InferenceServerException):
            client.infer(
                "fraud",
                [inp],
                request_id="access-grpc-denied",
                headers={"x-api-key": api_key[:-4] + "XXXX"},  # a near-miss key
            )
    finally:
        client.close()
    body = {
        "inputs": [
            {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [float(MARKER)] * 64}
        ]
    }
    resp = httpx.post(
        f"http://{stack.http_url}/v2/models/fraud/infer",
        json={"id": "access-http-1", **body},
        headers={"x-api-key": api_key},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text

    def access(rid: str) -> dict[str, object]:
        deadline = time.monotonic() + 10
        while True:
            for service, line in _log_lines(stack):
                if service == "gateway" and line.startswith("{"):
                    rec = json.loads(line)
                    if (
                        rec.get("logger") == "inferbus_gateway.access"
                        and rec.get("request_id") == rid
                    ):
                        return rec
            if time.monotonic() > deadline:
                raise AssertionError(f"no access-log line for {rid}")
            time.sleep(0.05)

    ok = access("access-grpc-1")
    for key in ("ts", "level", "service", "request_id", "trace_id", "model", "version"):
        assert ok[key], key
    assert (ok["level"], ok["service"], ok["model"], ok["version"]) == (
        "INFO",
        "gateway",
        "fraud",
        "1",
    )
    assert (ok["tenant"], ok["status"], ok["protocol"]) == ("acme", "OK", "grpc")
    assert isinstance(ok["latency_ms"], float) and ok["latency_ms"] > 0
    # The logged trace id is the request's trace: its gateway span was exported.
    collector.wait_for(
        lambda s: any(
            sp.trace_id == ok["trace_id"] and sp.name == "inferbus.gateway.infer" for sp in s
        )
    )
    denied = access("access-grpc-denied")
    assert denied["status"] == "UNAUTHENTICATED" and "tenant" not in denied
    http = access("access-http-1")
    assert (http["protocol"], http["status"], http["tenant"]) == ("http", "OK", "acme")

    # No line of any service holds the key (whole, or the near-miss) or the tensors.
    payload_forms = {
        x.tobytes()[:16].hex(),
        base64.b64encode(x.tobytes()[:24]).decode(),
        "12345.6",  # the marker in decimal
        repr(x.tobytes()[:8])[2:-1],  # the marker as a Python bytes literal
    }
    lines = _log_lines(stack)
    assert len(lines) > 10
    for service, line in lines:
        assert api_key not in line and api_key[:-4] not in line, (service, line)
        for form in payload_forms:
            assert form not in line, (service, form, line)
