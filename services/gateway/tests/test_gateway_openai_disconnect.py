"""A client that leaves cancels its generation in the worker, streamed or not.

Real uvicorn on a loopback socket (disconnects are TCP closes, not an ASGI
transport's bookkeeping), real nats-server; the test answers on the route
subject like an LLM worker that never finishes on its own, and records the
cancel the gateway publishes on ``ib.gencancel.<request id>``. Like a worker,
the stand-in only acts on a cancel for a request it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from starlette.applications import Starlette

from inferbus_common import bus, ops
from inferbus_common.catalog import Catalog
from inferbus_common.generation import GenerationChunk
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects
from inferbus_gateway.generation import GenerationDispatcher, GenerationService
from inferbus_gateway.rest.openai import REQUEST_ID_HEADER, openai_routes

from .test_gateway_openai_edge import _serve

pytestmark = pytest.mark.integration

SUBJECTS = Subjects("ib")


@dataclass
class Endless:
    """An LLM worker stand-in: one chunk every 5 ms until the request is cancelled."""

    url: str
    cancelled: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    """Every cancel received, held request or not."""
    stopped: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    """Requests whose generation a cancel stopped."""
    sent: dict[str, int] = field(default_factory=dict)
    first_after_s: float = 0.0
    """Delay of a held request's first chunk (as a request queued in the engine)."""
    take_after_cancel: bool = False
    """Hold a request only once its cancel went by (a request slower on its way
    through the router than its cancel, which goes to the workers directly)."""


@pytest.fixture
async def endless(nats_client: Client) -> AsyncIterator[Endless]:
    tasks: dict[str, asyncio.Task[None]] = {}
    waiting: dict[str, str] = {}
    box: list[Endless] = []

    async def stream(request_id: str, reply: str) -> None:
        await asyncio.sleep(box[0].first_after_s)
        seq = 0
        while True:
            chunk = GenerationChunk(text="tok ", tokens=1)
            await nats_client.publish(
                reply, chunk.encode(), headers={h.SEQ: str(seq), h.VERSION: "1"}
            )
            box[0].sent[request_id] = seq = seq + 1
            await asyncio.sleep(0.005)

    async def on_request(msg: Msg) -> None:
        headers = msg.headers or {}
        rid = headers[h.REQUEST_ID]
        if box[0].take_after_cancel:
            waiting[rid] = headers[h.REPLY]
        else:
            tasks[rid] = asyncio.create_task(stream(rid, headers[h.REPLY]))

    async def on_cancel(msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        task = tasks.pop(rid, None)
        if task is not None:
            task.cancel()
            await box[0].stopped.put(rid)
        elif rid in waiting:  # this cancel is lost; the request arrives after it
            tasks[rid] = asyncio.create_task(stream(rid, waiting.pop(rid)))
        await box[0].cancelled.put(rid)

    subs = [
        await nats_client.subscribe(SUBJECTS.gen_route_all, cb=on_request),
        await nats_client.subscribe(SUBJECTS.gen_cancel_all, cb=on_cancel),
    ]
    await bus.sync(nats_client)
    dispatcher = GenerationDispatcher(nats_client, SUBJECTS, "gw-test")
    await dispatcher.start()
    sock = ops.bind_socket("127.0.0.1", 0)
    try:
        async with Catalog(nats_client.jetstream(), SUBJECTS) as catalog:
            _serve(catalog, "llm")
            app = Starlette(routes=openai_routes(GenerationService(catalog, dispatcher)))
            async with ops.serve_http(app, sock):
                box.append(Endless(f"http://127.0.0.1:{sock.getsockname()[1]}"))
                yield box[0]
    finally:
        for task in tasks.values():
            task.cancel()
        await dispatcher.stop()
        for sub in subs:
            await sub.unsubscribe()


BODY = {"model": "llm", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 10**6}


async def _cancelled_within(endless: Endless, bound_s: float) -> str:
    async with asyncio.timeout(bound_s):
        return await endless.cancelled.get()


async def test_a_streaming_client_that_leaves_cancels_the_generation(endless: Endless) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream(
            "POST", f"{endless.url}/v1/chat/completions", json={**BODY, "stream": True}
        ) as resp:
            assert resp.status_code == 200
            rid = resp.headers[REQUEST_ID_HEADER]
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # leaving the block closes the connection
    assert await _cancelled_within(endless, 5.0) == rid
    sent = endless.sent[rid]
    await asyncio.sleep(0.1)
    assert endless.sent[rid] == sent  # the stand-in stopped: nothing more generated


async def test_a_client_that_stops_reading_and_leaves_cancels_it_too(endless: Endless) -> None:
    """Not reading fills the socket buffers and blocks the gateway's sends; the
    close must still be noticed (the blocked send is not what detects it)."""
    async with httpx.AsyncClient(timeout=10) as http:
        async with http.stream(
            "POST",
            f"{endless.url}/v1/completions",
            json={"model": "llm", "prompt": "x", "max_tokens": 10**6, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            rid = resp.headers[REQUEST_ID_HEADER]
            await asyncio.sleep(1.0)  # ~200 chunks pile up unread
    assert await _cancelled_within(endless, 5.0) == rid


async def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(
    endless: Endless,
) -> None:
    """Without a stream nothing is sent until the end, so only a disconnect
    watcher can tell; vLLM's own server aborts such requests too."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection
            await http.post(f"{endless.url}/v1/chat/completions", json=BODY)
    rid = await _cancelled_within(endless, 5.0)
    assert rid in endless.sent
    # The gateway keeps serving after it.
    async with httpx.AsyncClient(timeout=10) as http:
        resp = await http.get(f"{endless.url}/v1/models")
        assert resp.status_code == 200 and resp.json()["data"][0]["id"] == "llm"
    with contextlib.suppress(asyncio.QueueEmpty):
        assert endless.cancelled.get_nowait() != rid  # exactly one cancel per request


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_client_that_leaves_before_the_first_chunk_cancels_at_once(
    endless: Endless, stream: bool
) -> None:
    """A request that waits for its first chunk (queued in the engine behind
    running ones, or a slow prefill) is cancelled when its client leaves, not
    when that chunk comes. Nothing is sent to a client before it, streamed or not."""
    endless.first_after_s = 60.0
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection
            await http.post(f"{endless.url}/v1/chat/completions", json={**BODY, "stream": stream})
    rid = await _cancelled_within(endless, 5.0)
    assert endless.stopped.get_nowait() == rid  # the stand-in held it: the cancel stopped it
    assert rid not in endless.sent  # before its first chunk


async def test_a_cancel_that_overtakes_its_request_is_sent_again(endless: Endless) -> None:
    """The cancel of a request that no worker held yet is lost; the gateway sends
    it again when the request's first chunk comes, so it is not generated to the
    end for nobody."""
    endless.take_after_cancel = True
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection
            await http.post(f"{endless.url}/v1/chat/completions", json=BODY)
    rid = await _cancelled_within(endless, 5.0)
    assert endless.stopped.empty()  # the first cancel found nothing to stop
    async with asyncio.timeout(5.0):
        assert await endless.stopped.get() == rid
    assert endless.cancelled.get_nowait() == rid  # the second cancel stopped it
    sent = endless.sent[rid]
    await asyncio.sleep(0.1)
    assert endless.sent[rid] == sent  # the stand-in stopped: nothing more generated
