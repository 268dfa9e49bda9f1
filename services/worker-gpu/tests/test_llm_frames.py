"""Chunk frames: one message per engine step and gateway, not per stream (real nats-server).

The worker side is a `VersionServer` over a scripted engine whose streams all
step together when the test says so (vLLM is not in the workspace
environment); the gateway side is the gateway's own `GenerationDispatcher` and
`ChunkStream`. The same path with a real vLLM engine runs in
tests/e2e/test_e2e_llm.py and in ``bench/llm_vs_vllm.py``. Also here: the
engine's warm-up generation before a version takes requests.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import ResourceExhausted, Unavailable
from inferbus_common.generation import GenerationRequest, pack_chunk, unpack_chunks
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects
from inferbus_gateway.generation import ChunkStream, GenerationDispatcher
from inferbus_worker.llm.engine import EngineDead, LlmEngine, Step
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.versionserver import VersionServer, _split_frames

from .test_llm_recovery import _config, wait_until

_names = itertools.count()


class LockstepEngine(LlmEngine):
    """Every stream makes one token per `tick`, all in the same loop turn, as
    vLLM's output handler wakes all running requests after one engine step."""

    def start(self) -> None:
        self._llm = self
        self._tick = asyncio.Event()
        self.fail_next = False
        self.waiting = 0
        """Streams waiting for the next tick."""
        self.pad: dict[str, int] = {}
        """Prompt → bytes added to each of its chunks' text."""

    def render(self, request: GenerationRequest) -> list[int]:
        return [1, 2]

    def tick(self) -> None:
        """Release one step of every stream."""
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def generate(
        self, request_id: str, request: GenerationRequest, prompt_ids: list[int]
    ) -> AsyncIterator[Step]:
        n = request.max_tokens or 3
        for i in range(n):
            self.waiting += 1
            try:
                await self._tick.wait()
            finally:
                self.waiting -= 1
            if self.fail_next:
                raise EngineDead()
            last = i + 1 == n
            text = f"{request.prompt}{i} " + "x" * self.pad.get(request.prompt, 0)
            yield Step(text, 1, "length" if last else None, 2, done=last)

    def shutdown(self, timeout_s: float | None = None) -> None:
        self._llm = None


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _read(stream: ChunkStream, into: list[str]) -> None:
    async for chunk in stream.chunks(h.deadline_from_timeout(10)):
        into.append(chunk.text)


async def _framing_pair(
    nats_url: str, tmp_path: Path
) -> tuple[nats.NATS, LockstepEngine, VersionServer, GenerationDispatcher, DeployedVersion]:
    nc = await nats.connect(nats_url)
    subjects = Subjects(f"fr{next(_names)}")
    dv = DeployedVersion(model=f"f{next(_names)}", version="1", config=_config())
    engine = LockstepEngine(dv.config, tmp_path, "cpu")
    engine.start()
    settings = LlmWorkerSettings(nats_url=nats_url, cache_dir=tmp_path, device="cpu")
    server = VersionServer(nc, subjects, dv, engine, settings)
    await server.start()
    gateway = GenerationDispatcher(nc, subjects, f"gw-{next(_names)}")
    await gateway.start()
    return nc, engine, server, gateway, dv


async def _send(
    gateway: GenerationDispatcher, dv: DeployedVersion, rid: str, prompt: str, n: int
) -> ChunkStream:
    reply, stream = gateway.open()
    headers = {h.REPLY: reply, h.REQUEST_ID: rid}
    if gateway.frames_subject:
        headers[h.CHUNK_FRAMES] = gateway.frames_subject
    body = GenerationRequest(kind="completion", prompt=prompt, max_tokens=n)
    await gateway.publish(gateway.subjects.gen(dv.model, "1"), body.encode(), headers)
    return stream


async def _read_all(
    nc: nats.NATS, engine: LockstepEngine, streams: dict[str, ChunkStream], steps: int
) -> dict[str, list[str]]:
    """Read every stream to its end while ticking `steps` engine steps, each once all
    of them wait and the last step's chunks are in; the texts, by stream."""
    texts: dict[str, list[str]] = {k: [] for k in streams}
    readers = [asyncio.create_task(_read(s, texts[k])) for k, s in streams.items()]
    await bus.sync(nc)
    for step in range(steps):
        await wait_until(lambda: engine.waiting == len(texts), 5)
        engine.tick()
        await wait_until(lambda s=step: min(len(t) for t in texts.values()) > s, 5)
    async with asyncio.timeout(5):
        await asyncio.gather(*readers)
    return texts


async def test_the_chunks_of_one_step_travel_in_one_frame_per_gateway(
    nats_url: str, tmp_path: Path
) -> None:
    nc, engine, server, framed, dv = await _framing_pair(nats_url, tmp_path)
    single = GenerationDispatcher(nc, framed.subjects, "gw-b", chunk_frames=False)
    labels = {"model": dv.model, "version": "1"}
    try:
        await single.start()
        assert framed.frames_subject.endswith(".gen.frames") and not single.frames_subject

        # Two streams of the framing gateway and one of the other, four steps.
        streams = {
            "a": await _send(framed, dv, "ra", "a", 4),
            "b": await _send(framed, dv, "rb", "b", 4),
            "c": await _send(single, dv, "rc", "c", 4),
        }
        texts = await _read_all(nc, engine, streams, 4)
        for key in texts:
            assert texts[key] == [f"{key}{i} " for i in range(4)], texts
        # One frame per step carried both of gw-a's streams; gw-b got one message a chunk.
        assert _sample("inferbus_llm_chunk_messages_total", **labels, how="frame") == 4
        assert _sample("inferbus_llm_framed_chunks_total", **labels) == 8
        assert _sample("inferbus_llm_chunk_messages_total", **labels, how="single") == 4
        assert streams["a"].version == streams["b"].version == "1"

        # An error after framed chunks comes after them: the stream yields its
        # chunks, then fails with the worker's error, not a gap.
        got: list[str] = []
        failing = await _send(framed, dv, "rd", "d", 5)
        reader = asyncio.create_task(_read(failing, got))
        await bus.sync(nc)
        await wait_until(lambda: engine.waiting == 1, 5)
        engine.tick()
        await wait_until(lambda: bool(got) and engine.waiting == 1, 5)
        engine.fail_next = True
        engine.tick()
        with pytest.raises(Unavailable, match="engine died"):
            await reader
        assert got == ["d0 "]
    finally:
        await server.stop(1.0)
        for d in (framed, single):
            await d.stop()
        await nc.close()


async def test_frames_stay_within_max_payload_and_a_chunk_too_big_for_the_bus_fails_alone(
    nats_url: str, tmp_path: Path
) -> None:
    nc, engine, server, gateway, dv = await _framing_pair(nats_url, tmp_path)
    labels = {"model": dv.model, "version": "1"}
    try:
        # Four streams of ~300 kB chunks: one step's chunks pass nats-server's
        # 1 MiB max_payload together, so each step goes as two frames.
        assert nc.max_payload == 1 << 20
        for k in "abcd":
            engine.pad[k] = 300_000
        streams = {k: await _send(gateway, dv, f"r{k}", k, 2) for k in "abcd"}
        texts = await _read_all(nc, engine, streams, 2)
        for k in texts:
            assert texts[k] == [f"{k}{i} " + "x" * 300_000 for i in range(2)]
        assert _sample("inferbus_llm_chunk_messages_total", **labels, how="frame") == 4
        assert _sample("inferbus_llm_framed_chunks_total", **labels) == 8

        # A chunk larger than any bus message ends its own stream with a clear
        # RESOURCE_EXHAUSTED; the stream beside it is not touched.
        engine.pad["big"] = (1 << 20) + 10
        got: dict[str, list[str]] = {"big": [], "ok": []}
        big = asyncio.create_task(_read(await _send(gateway, dv, "rbig", "big", 2), got["big"]))
        ok = asyncio.create_task(_read(await _send(gateway, dv, "rok", "ok", 2), got["ok"]))
        await bus.sync(nc)
        await wait_until(lambda: engine.waiting == 2, 5)
        engine.tick()
        await wait_until(lambda: len(got["ok"]) == 1 and engine.waiting == 1, 5)
        engine.tick()
        with pytest.raises(ResourceExhausted, match="max_payload 1048576"):
            async with asyncio.timeout(5):
                await big
        async with asyncio.timeout(5):
            await ok
        assert got == {"big": [], "ok": ["ok0 ", "ok1 "]}
    finally:
        await server.stop(1.0)
        await gateway.stop()
        await nc.close()


async def test_streams_of_a_frame_the_bus_refused_are_aborted(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nc, engine, server, gateway, dv = await _framing_pair(nats_url, tmp_path)
    labels = {"model": dv.model, "version": "1", "why": "publish"}
    publish = nc.publish

    async def refuse_frames(subject: str, payload: bytes = b"", **kw: object) -> None:
        if subject == gateway.frames_subject:
            raise nats.errors.OutboundBufferLimitError
        await publish(subject, payload, **kw)  # type: ignore[arg-type]

    try:
        streams = [await _send(gateway, dv, f"p{i}", f"p{i}", 50) for i in range(2)]
        await bus.sync(nc)
        await wait_until(lambda: engine.waiting == 2, 5)
        monkeypatch.setattr(nc, "publish", refuse_frames)
        engine.tick()
        # Both streams' tasks end (the engine request is aborted), not 48 more steps.
        await wait_until(lambda: server.in_flight == 0, 5)
        assert engine.waiting == 0
        assert _sample("inferbus_llm_aborted_total", **labels) == 2
        assert not any(s.received for s in streams)  # the one frame was lost

        # A request is aborted once, however many of its chunks were lost: a
        # second abort while its task winds down is refused and not counted.
        monkeypatch.setattr(nc, "publish", publish)
        await _send(gateway, dv, "p2", "p2", 50)
        await bus.sync(nc)
        await wait_until(lambda: server.in_flight == 1, 5)
        assert server.cancel("p2", "publish") is True
        assert server.cancel("p2", "publish") is False
        await wait_until(lambda: server.in_flight == 0, 5)
        assert _sample("inferbus_llm_aborted_total", **labels) == 3
    finally:
        await server.stop(1.0)
        await gateway.stop()
        await nc.close()


async def test_a_malformed_frame_is_dropped_and_counted_and_the_gateway_goes_on(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    subjects = Subjects(f"fr{next(_names)}")
    d = GenerationDispatcher(nc, subjects, "gw-x")
    await d.start()
    try:
        before = _sample("inferbus_gateway_gen_bad_frames_total")
        reply, stream = d.open()
        good = pack_chunk(reply, 0, True, b'{"text": "ok", "tokens": 1}')
        await nc.publish(d.frames_subject, good[:-3], headers={h.VERSION: "1"})
        await nc.publish(d.frames_subject, good, headers={h.VERSION: "1"})
        got: list[str] = []
        async with asyncio.timeout(5):
            await _read(stream, got)
        assert got == ["ok"]
        assert _sample("inferbus_gateway_gen_bad_frames_total") == before + 1
    finally:
        await d.stop()
        await nc.close()


def test_frames_round_trip_and_refuse_truncation() -> None:
    entries = [("ib.reply.g.gen.1", 0, False, b"{}"), ("ib.reply.g.gen.22", 7, True, b"")]
    frame = b"".join(pack_chunk(*e) for e in entries)
    assert list(unpack_chunks(frame)) == entries
    packed = [(f"r{i}", pack_chunk("ib.reply.g.gen.1", i, False, b"x" * 10)) for i in range(5)]
    size = len(packed[0][1])
    split = _split_frames(packed, 2 * size)
    assert [rids for rids, _ in split] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert b"".join(frame for _, frame in split) == b"".join(e for _, e in packed)
    for cut in (1, 5, len(frame) - 1):
        with pytest.raises(ValueError, match="chunk frame ends"):
            list(unpack_chunks(frame[:cut]))


class Recording(LlmEngine):
    """Records what `warm_up` asks of the engine; fails on demand."""

    def start(self) -> None:
        self._llm = self
        self.calls: list[tuple[str, int | None, list[int]]] = []
        self.fail = False

    def render(self, request: GenerationRequest) -> list[int]:
        return [7, 8]

    async def generate(
        self, request_id: str, request: GenerationRequest, prompt_ids: list[int]
    ) -> AsyncIterator[Step]:
        self.calls.append((request_id, request.max_tokens, prompt_ids))
        if self.fail:
            raise RuntimeError("no memory for the warm-up")
        yield Step("x", 1, "length", 2, done=True)


async def test_warm_up_generates_one_token_and_a_failure_is_only_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Recording(_config(), tmp_path, "cpu")
    engine.start()
    await engine.warm_up()
    assert [(rid.startswith("warm-up-"), n, ids) for rid, n, ids in engine.calls] == [
        (True, 1, [7, 8])
    ]
    engine.fail = True
    await engine.warm_up()  # does not raise
    assert "the warm-up generation failed: no memory for the warm-up" in caplog.text
