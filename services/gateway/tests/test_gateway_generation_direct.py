"""Direct dispatch of generative requests: a plain route to a version one LLM worker
serves goes straight to ``ib.gen.<model>.<version>``, anything the router has to decide
(several workers to place among, a canary draw) goes through ``ib.genroute``; no worker
taking it is a 429 naming the model at once.

Real nats-server; the test answers like an LLM worker (the worker itself needs vLLM,
see tests/e2e/test_e2e_llm.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from starlette.applications import Starlette

from inferbus_common.catalog import Catalog, DeployedVersion, Route, WorkerStatus
from inferbus_common.generation import GenerationChunk, GenerationRequest
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects
from inferbus_gateway.generation import GenerationDispatcher, GenerationService
from inferbus_gateway.rest.openai import openai_routes

SUBJECTS = Subjects("ib")
BODY = {"model": "llm", "prompt": "hi", "max_tokens": 2}


def _worker(worker_id: str, versions: list[str]) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        pool="llm",
        models={f"llm/{v}": "ready" for v in versions},
        ts_ms=int(time.time() * 1000),
    )


class _Where:
    """Answers like an LLM worker on both subjects; notes which one each request took."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.took: list[tuple[str, str]] = []

    def on(self, where: str):  # type: ignore[no-untyped-def]
        async def answer(msg: Msg) -> None:
            headers = msg.headers or {}
            self.took.append((where, headers.get(h.VERSION, "")))
            chunk = GenerationChunk(
                text="ok", tokens=1, finish_reason="stop", prompt_tokens=1, completion_tokens=1
            )
            out = {h.SEQ: "0", h.VERSION: headers.get(h.VERSION, ""), h.FINAL: "1"}
            await self.nc.publish(headers[h.REPLY], chunk.encode(), headers=out)

        return answer


@pytest.fixture
async def stack(nats_client: Client) -> AsyncIterator[tuple[GenerationService, Catalog, _Where]]:
    where = _Where(nats_client)
    router = await nats_client.subscribe(SUBJECTS.gen_route_all, cb=where.on("router"))
    try:
        async with Catalog(nats_client.jetstream(), SUBJECTS) as catalog:
            catalog.routes["llm"] = Route(model="llm", stable="1", versions=["1", "2"])
            config = ModelConfig.model_validate(
                {
                    "name": "llm",
                    "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1]}],
                    "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
                    "engine": {"kind": "vllm"},
                    "max_batch_size": 0,
                }
            )
            for v in ("1", "2"):
                catalog.versions[("llm", v)] = DeployedVersion(
                    model="llm", version=v, config=config
                )
            catalog.workers["w-1"] = _worker("w-1", ["1", "2"])
            dispatcher = GenerationDispatcher(nats_client, SUBJECTS, "gw-direct", catalog=catalog)
            await dispatcher.start()
            try:
                yield GenerationService(catalog, dispatcher, direct=True), catalog, where
            finally:
                await dispatcher.stop()
    finally:
        await router.unsubscribe()


def _client(service: GenerationService) -> httpx.AsyncClient:
    app = Starlette(routes=openai_routes(service))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def test_a_plain_route_with_one_worker_skips_the_router(
    stack: tuple[GenerationService, Catalog, _Where], nats_client: Client
) -> None:
    service, catalog, where = stack
    worker = await nats_client.subscribe(SUBJECTS.gen("llm", "1"), queue="llm", cb=where.on("w"))
    try:
        async with _client(service) as http:
            first = await http.post("/v1/completions", json=BODY)
            catalog.workers["w-2"] = _worker("w-2", ["1"])  # a choice: the router places
            second = await http.post("/v1/completions", json=BODY)
            del catalog.workers["w-2"]
            catalog.routes["llm"] = Route(
                model="llm", stable="1", versions=["1", "2"], canary="2", canary_weight=50.0
            )  # a draw: the router's
            third = await http.post("/v1/completions", json=BODY)
        # A pin is decided without a draw, even on a route with a canary.
        call = await service.open(
            "llm", GenerationRequest(kind="completion", prompt="hi", max_tokens=2), {}, version="1"
        )
        pinned = [chunk.text async for chunk in call.chunks()]
    finally:
        await worker.unsubscribe()
    for answer in (first, second, third):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "ok"
    assert where.took == [("w", "1"), ("router", ""), ("router", ""), ("w", "1")]
    assert pinned == ["ok"]


async def test_no_worker_taking_a_direct_request_is_a_429_at_once(
    stack: tuple[GenerationService, Catalog, _Where],
) -> None:
    service, _catalog, where = stack
    async with _client(service) as http:
        t0 = time.monotonic()
        refused = await http.post("/v1/completions", json=BODY)
    assert refused.status_code == 429, refused.text
    assert time.monotonic() - t0 < 2.0
    message = refused.json()["error"]["message"]
    assert "model 'llm' version '1'" in message and "nothing was generated" in message
    assert refused.headers["X-Inferbus-Reason"] == "llm-full"
    assert where.took == []
