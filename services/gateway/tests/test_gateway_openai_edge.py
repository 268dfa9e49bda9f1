"""The OpenAI endpoints' edge, like V2's: one access-log line per request, a server
span when tracing samples it, and ``/v1/models`` filtered by the tenant's access list.

Real nats-server and redis-server; the test answers on the route subject with chunks
the way an LLM worker does (the worker itself needs vLLM, see tests/e2e/test_e2e_llm.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette

from inferbus_common import tracing
from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.catalog import Catalog, DeployedVersion, Route, WorkerStatus
from inferbus_common.generation import GenerationChunk
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.settings import ServiceSettings
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission import Admission
from inferbus_gateway.admission.auth import Authenticator
from inferbus_gateway.generation import GenerationDispatcher, GenerationService
from inferbus_gateway.rest.openai import openai_routes
from inferbus_testing.servers import RedisServer

SUBJECTS = Subjects("ib")
CLIENT_TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _config(name: str) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
            "engine": {"kind": "vllm"},
            "max_batch_size": 0,
        }
    )


def _serve(catalog: Catalog, *names: str) -> None:
    """Put generative models in the catalog, served by a fresh, ready worker."""
    for name in names:
        catalog.routes[name] = Route(model=name, stable="1", versions=["1"])
        catalog.versions[(name, "1")] = DeployedVersion(
            model=name, version="1", config=_config(name)
        )
    catalog.workers["w-llm"] = WorkerStatus(
        worker_id="w-llm",
        pool="llm",
        models={f"{n}/1": "ready" for n in names},
        ts_ms=int(time.time() * 1000),
    )


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


@pytest.fixture
async def service(nats_client: Client) -> AsyncIterator[GenerationService]:
    """A GenerationService and a responder that answers like an LLM worker."""
    seen: list[dict[str, str]] = []

    async def answer(msg: Msg) -> None:
        headers = msg.headers or {}
        seen.append(dict(headers))
        reply = headers[h.REPLY]
        words = ["Hello", " there"]
        for seq, word in enumerate(words):
            chunk = GenerationChunk(text=word, tokens=1)
            out = {h.SEQ: str(seq), h.VERSION: "1"}
            if seq == len(words) - 1:
                chunk = GenerationChunk(
                    text=word, tokens=1, finish_reason="stop", prompt_tokens=3, completion_tokens=2
                )
                out[h.FINAL] = "1"
            await nats_client.publish(reply, chunk.encode(), headers=out)

    sub = await nats_client.subscribe(SUBJECTS.gen_route_all, cb=answer)
    dispatcher = GenerationDispatcher(nats_client, SUBJECTS, "gw-test")
    await dispatcher.start()
    try:
        async with Catalog(nats_client.jetstream(), SUBJECTS) as catalog:
            _serve(catalog, "llm")
            svc = GenerationService(catalog, dispatcher)
            svc.seen = seen  # type: ignore[attr-defined]
            yield svc
    finally:
        await dispatcher.stop()
        await sub.unsubscribe()


def _client(service: GenerationService) -> httpx.AsyncClient:
    app = Starlette(routes=openai_routes(service))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "inferbus_gateway.access"]


async def test_each_openai_request_logs_one_access_line(
    service: GenerationService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}
    async with _client(service) as http:
        plain = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "a1"})
        streamed = await http.post(
            "/v1/completions", json={"model": "llm", "prompt": "hi", "stream": True}
        )
        missing = await http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        broken = await http.post("/v1/completions", content=b"{not json")
    assert (
        plain.status_code == 200
        and plain.json()["choices"][0]["message"]["content"] == "Hello there"
    )
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert (missing.status_code, broken.status_code) == (404, 400)
    lines = _lines(caplog)
    assert [(r.model, r.status, r.protocol) for r in lines] == [  # type: ignore[attr-defined]
        ("llm", "OK", "openai"),
        ("llm", "OK", "openai"),
        ("nope", "NOT_FOUND", "openai"),
        ("", "INVALID_ARGUMENT", "openai"),
    ]
    assert lines[0].request_id == "a1" and lines[0].version == "1"  # type: ignore[attr-defined]
    assert lines[1].version == "1" and lines[1].latency_ms > 0  # type: ignore[attr-defined]
    for record in lines:
        assert "authorization" not in record.__dict__ and "x-api-key" not in record.__dict__


async def test_access_log_off_writes_no_line(
    service: GenerationService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    service.access_log = False
    async with _client(service) as http:
        ok = await http.post("/v1/completions", json={"model": "llm", "prompt": "hi"})
    assert ok.status_code == 200 and not _lines(caplog)


async def test_sampled_openai_request_gets_a_server_span_that_travels(
    service: GenerationService, spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    async with _client(service) as http:
        ok = await http.post(
            "/v1/completions",
            json={"model": "llm", "prompt": "hi"},
            headers={"traceparent": CLIENT_TP},
        )
    assert ok.status_code == 200
    (span,) = [s for s in spans.get_finished_spans() if s.name == "inferbus.gateway.infer"]
    assert span.attributes["inferbus.protocol"] == "openai"
    assert span.attributes["inferbus.model"] == "llm"
    assert span.attributes["inferbus.version"] == "1"
    assert format(span.context.trace_id, "032x") == CLIENT_TP.split("-")[1]
    # The worker receives this span's context, not the client's.
    forwarded = service.seen[-1][h.TRACEPARENT]  # type: ignore[attr-defined]
    assert forwarded != CLIENT_TP and format(span.context.span_id, "016x") in forwarded
    (line,) = _lines(caplog)
    assert line.trace_id == CLIENT_TP.split("-")[1]  # type: ignore[attr-defined]


async def test_model_list_shows_only_what_the_tenant_may_call(
    service: GenerationService, redis_server: RedisServer
) -> None:
    _serve(service.catalog, "llm", "llm-b", "llm-c")
    client = connect_redis(redis_server.url)
    try:
        store = KeyStore(client, AdmissionKeys("t"))
        _, acme = await store.create_key("acme")
        _, root = await store.create_key("root")
        await store.allow_models("acme", "llm-b")
        await store.allow_models("root", "*")
        service.admission = Admission(authenticator=Authenticator(store=store))
        async with _client(service) as http:
            anonymous = await http.get("/v1/models")
            acme_list = await http.get("/v1/models", headers={"x-api-key": acme})
            root_list = await http.get("/v1/models", headers={"x-api-key": root})
        service.admission = None
        async with _client(service) as http:
            open_list = await http.get("/v1/models")
    finally:
        await client.aclose()
    assert anonymous.status_code == 401
    assert [m["id"] for m in acme_list.json()["data"]] == ["llm-b"]
    assert [m["id"] for m in root_list.json()["data"]] == ["llm", "llm-b", "llm-c"]
    assert [m["id"] for m in open_list.json()["data"]] == ["llm", "llm-b", "llm-c"]


async def test_a_stream_read_in_parts_logs_exactly_one_line(
    service: GenerationService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferbus_gateway.access")
    async with _client(service) as http:
        async with http.stream(
            "POST", "/v1/completions", json={"model": "llm", "prompt": "hi", "stream": True}
        ) as resp:
            assert resp.status_code == 200
    await asyncio.sleep(0)
    # Once, whichever path ends it (the stream's own end or the response's cleanup).
    (line,) = _lines(caplog)
    assert line.status in ("OK", "CANCELLED")  # type: ignore[attr-defined]
