"""The gateway's generative plumbing against real servers: chunk ordering over
NATS, the tokens-per-minute buckets in Redis, and the OpenAI request/error shapes."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from inferbus_common import bus
from inferbus_common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from inferbus_common.generation import GenerationChunk
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_headers
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission.tokens import TokenLimiter, estimate_prompt_tokens, set_tpm_limit
from inferbus_gateway.generation import ChunkStream, GenerationDispatcher
from inferbus_gateway.rest.openai import error_body
from inferbus_gateway.rest.openai_request import parse_openai


async def _chunks(dispatcher: GenerationDispatcher, nc, order: list[int], *, final: int) -> list:
    """Publish chunks `order` (seq numbers) to a fresh stream; collect what it yields."""
    reply, stream = dispatcher.open()
    await bus.sync(nc)
    for seq in order:
        headers = {h.SEQ: str(seq)}
        if seq == final:
            headers[h.FINAL] = "1"
        body = GenerationChunk(text=f"<{seq}>", tokens=1).encode()
        await nc.publish(reply, body, headers=headers)
    await bus.sync(nc)
    got = []
    async for chunk in stream.chunks(h.deadline_from_timeout(5.0)):
        got.append(chunk.text)
    return got


async def test_chunks_are_reordered_and_duplicates_dropped(nats_client) -> None:
    dispatcher = GenerationDispatcher(nats_client, Subjects("ib"), "gw-test")
    await dispatcher.start()
    try:
        got = await _chunks(dispatcher, nats_client, [0, 2, 1, 1, 4, 3], final=4)
        assert got == ["<0>", "<1>", "<2>", "<3>", "<4>"]
    finally:
        await dispatcher.stop()


async def test_a_gap_fails_the_stream_cleanly(nats_client) -> None:
    dispatcher = GenerationDispatcher(nats_client, Subjects("ib"), "gw-test")
    await dispatcher.start()
    try:
        reply, stream = dispatcher.open()
        stream._gap_timeout_s = 0.2
        await bus.sync(nats_client)
        for seq in (0, 2, 3):  # 1 never comes
            await nats_client.publish(
                reply, GenerationChunk(text="x", tokens=1).encode(), headers={h.SEQ: str(seq)}
            )
        got = []
        with pytest.raises(Unavailable, match="lost chunk 1"):
            async for chunk in stream.chunks(h.deadline_from_timeout(5.0)):
                got.append(chunk)
        assert len(got) == 1
    finally:
        await dispatcher.stop()


async def test_an_error_chunk_or_router_error_raises_its_status(nats_client) -> None:
    dispatcher = GenerationDispatcher(nats_client, Subjects("ib"), "gw-test")
    await dispatcher.start()
    try:
        reply, stream = dispatcher.open()
        await bus.sync(nats_client)
        exc = ResourceExhausted("full", reason="llm-full")
        await nats_client.publish(reply, b"", headers={**error_headers(exc), h.SEQ: "0"})
        with pytest.raises(ResourceExhausted) as caught:
            async for _ in stream.chunks(h.deadline_from_timeout(5.0)):
                pass
        assert caught.value.reason == "llm-full"
        # The router answers without Ib-Seq (e.g. an unknown version).
        reply, stream = dispatcher.open()
        await bus.sync(nats_client)
        await nats_client.publish(reply, b"", headers=error_headers(NotFound("no version 9")))
        with pytest.raises(NotFound):
            async for _ in stream.chunks(h.deadline_from_timeout(5.0)):
                pass
    finally:
        await dispatcher.stop()


async def test_tpm_bucket_refuses_after_settled_debt_and_refills(redis_server) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        limiter = TokenLimiter(r, "ib")
        await limiter.reserve("acme", 10)  # no limit configured: admitted
        await set_tpm_limit(r, "ib", "acme", tpm=600, burst=50)  # 10 tokens/s
        await limiter.reserve("acme", 10)
        await limiter.settle("acme", 10, 80)  # 80 used in all: 30 in debt
        with pytest.raises(ResourceExhausted) as refused:
            await limiter.reserve("acme", 5)
        assert refused.value.reason == "tenant-tpm"
        assert 2.0 < refused.value.retry_after_s < 5.0  # ~35 tokens at 10/s
        await limiter.reserve("globex", 5)  # other tenants are not affected
        await limiter.settle("acme", 100, 0)  # a refund pays the debt back
        await limiter.reserve("acme", 5)
    finally:
        await r.aclose()


async def _evalsha_calls(r: aioredis.Redis) -> int:
    return int((await r.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def test_tpm_charges_only_tenants_with_a_limit_once_limits_are_loaded(redis_server) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.delete("ib2:tpm")
        async with TokenLimiter(r, "ib2", reload_interval_s=0.05) as limiter:
            before = await _evalsha_calls(r)
            assert await limiter.reserve("acme", 10) is False  # no limit: no Redis call
            assert await _evalsha_calls(r) == before
            await set_tpm_limit(r, "ib2", "acme", tpm=600, burst=50)
            for _ in range(100):  # the reload loop picks the limit up
                if limiter.limited("acme"):
                    break
                await asyncio.sleep(0.02)
            assert limiter.limited("acme") and not limiter.limited("globex")
            assert await limiter.reserve("acme", 40) is True
            charged = await _evalsha_calls(r)
            assert charged > before
            with pytest.raises(ResourceExhausted):  # charged for real: the bucket is short
                await limiter.reserve("acme", 40)
            charged = await _evalsha_calls(r)
            assert await limiter.reserve("globex", 10**6) is False
            assert await _evalsha_calls(r) == charged
            await set_tpm_limit(r, "ib2", "*", tpm=600, burst=50)
            await limiter.reload()
            with pytest.raises(ResourceExhausted):  # '*' limits every other tenant
                await limiter.reserve("globex", 10**6)
    finally:
        await r.delete("ib2:tpm", "{ib2:tpm}:acme", "{ib2:tpm}:globex")
        await r.aclose()


async def test_tpm_fails_open_when_redis_is_down() -> None:
    r = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    try:
        await TokenLimiter(r, "ib").reserve("acme", 10**9)
    finally:
        await r.aclose()


def test_estimate_is_about_four_characters_a_token() -> None:
    assert estimate_prompt_tokens(["abcd" * 10]) == 10
    assert estimate_prompt_tokens([""]) == 1


def test_openai_request_parsing() -> None:
    parsed = parse_openai(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": None,
        },
        "chat",
    )
    assert (parsed.model, parsed.stream, parsed.include_usage) == ("m", True, True)
    req = parsed.request
    assert (req.max_tokens, req.stop, req.messages[0].content) == (7, ["\n"], "hi")
    parsed = parse_openai({"model": "m", "prompt": ["one"]}, "completion")
    assert parsed.request.prompt == "one" and not parsed.stream
    for bad in (
        {"messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 99},
        {"model": "m", "messages": []},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
    ):
        with pytest.raises(InvalidArgument):
            parse_openai(bad, "chat")
    with pytest.raises(InvalidArgument):
        parse_openai({"model": "m", "prompt": ["a", "b"]}, "completion")


def test_openai_error_shape() -> None:
    status, body, headers = error_body(ResourceExhausted("busy", reason="llm-full"))
    assert status == 429
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "llm-full"
    assert headers["Retry-After"] == "1"
    status, body, _ = error_body(NotFound("no model x"))
    assert (status, body["error"]["message"]) == (404, "no model x")
    status, body, _ = error_body(RuntimeError("secret detail"))
    assert status == 500 and "secret" not in body["error"]["message"]


async def test_stream_deadline(nats_client) -> None:
    dispatcher = GenerationDispatcher(nats_client, Subjects("ib"), "gw-test")
    await dispatcher.start()
    try:
        _, stream = dispatcher.open()
        with pytest.raises(DeadlineExceeded):
            async with asyncio.timeout(5):
                async for _ in stream.chunks(h.deadline_from_timeout(0.2)):
                    pass
    finally:
        await dispatcher.stop()


async def test_a_cancel_that_overtook_its_request_is_sent_again_once(
    nats_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams cancelled before any message came are remembered until their
    deadline, at most MAX_UNANSWERED of them: a first chunk then gets the cancel
    once more; a final chunk, an expired or an evicted stream gets nothing."""
    from inferbus_gateway import generation

    monkeypatch.setattr(generation, "MAX_UNANSWERED", 2)
    subjects = Subjects("ib")
    dispatcher = GenerationDispatcher(nats_client, subjects, "gw-test")
    await dispatcher.start()
    cancels: list[str] = []

    async def on_cancel(msg) -> None:
        cancels.append(msg.subject.rsplit(".", 1)[-1])

    await nats_client.subscribe(subjects.gen_cancel_all, cb=on_cancel)
    later = h.deadline_from_timeout(30.0)
    try:
        replies = {}
        for rid, until in [("gone", h.deadline_from_timeout(-1.0)), ("a", later), ("b", later)]:
            reply, _ = dispatcher.open()
            dispatcher.close_unanswered(reply, rid, until)
            replies[rid] = reply
        # Inserting "b" evicted the expired "gone"; then a third evicts the oldest.
        reply, _ = dispatcher.open()
        dispatcher.close_unanswered(reply, "c", later)
        replies["c"] = reply
        await bus.sync(nats_client)

        async def chunk(rid: str, final: bool = False) -> None:
            headers = {h.SEQ: "0", **({h.FINAL: "1"} if final else {})}
            await nats_client.publish(replies[rid], b"{}", headers=headers)

        for rid in ("gone", "a", "c", "c"):
            await chunk(rid)
        await chunk("b", final=True)  # the worker already finished: nothing to cancel
        await bus.sync(nats_client)
        await asyncio.sleep(0.3)
        assert cancels == ["c"]
    finally:
        await dispatcher.stop()


async def test_a_stream_that_stops_midway_ends_at_its_deadline(nats_client) -> None:
    """One timer serves the whole stream: chunks first, then silence, then the deadline."""
    dispatcher = GenerationDispatcher(nats_client, Subjects("ib"), "gw-test")
    await dispatcher.start()
    try:
        reply, stream = dispatcher.open()
        await bus.sync(nats_client)
        for seq in (0, 1):
            body = GenerationChunk(text=f"<{seq}>", tokens=1).encode()
            await nats_client.publish(reply, body, headers={h.SEQ: str(seq)})
        got = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(DeadlineExceeded):
            async with asyncio.timeout(5):
                async for chunk in stream.chunks(h.deadline_from_timeout(0.4)):
                    got.append(chunk.text)
        assert got == ["<0>", "<1>"]
        assert 0.3 < loop.time() - started < 2.0
    finally:
        await dispatcher.stop()


async def test_a_deadline_timer_that_fires_early_is_armed_again(monkeypatch) -> None:
    """The timer runs on the loop's clock, the deadline on the wall clock: a timer
    that fires before the deadline (clock steps) must not leave the wait without one."""
    stream = ChunkStream()
    real = h.remaining_s
    calls = {"n": 0}

    def skewed(deadline_ns: int) -> float:
        calls["n"] += 1
        # The first reading arms the timer 0.05 s early.
        return real(deadline_ns) - (0.05 if calls["n"] == 1 else 0.0)

    monkeypatch.setattr(h, "remaining_s", skewed)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeadlineExceeded):
        async with asyncio.timeout(5):
            async for _ in stream.chunks(h.deadline_from_timeout(0.3)):
                pass
    assert 0.25 < loop.time() - started < 2.0


async def test_a_message_with_an_unreadable_sequence_number_fails_the_stream(
    nats_client,
) -> None:
    dispatcher = GenerationDispatcher(nats_client, Subjects("ib"), "gw-test")
    await dispatcher.start()
    try:
        reply, stream = dispatcher.open()
        await bus.sync(nats_client)
        await nats_client.publish(reply, b"{}", headers={h.SEQ: "zero"})
        with pytest.raises(Unavailable, match="unexpected message"):
            async for _ in stream.chunks(h.deadline_from_timeout(5.0)):
                pass
    finally:
        await dispatcher.stop()
