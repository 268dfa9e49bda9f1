"""The batcher in-process against a real nats-server with JetStream.

Each test gets a fresh server (the shared ``nats_server`` fixture) and its own
subject prefix, so nothing of one test is seen by another.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from prometheus_client import REGISTRY

from inferbus_batcher.service import Batcher
from inferbus_batcher.settings import BatcherSettings
from inferbus_common.catalog import DeployedVersion, Route, ensure_kv
from inferbus_common.codec import Tensor
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import (
    BundledReply,
    BundledRequest,
    decode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.microbatch import MicroBatch, decode_batch
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_common.subjects import Subjects
from inferbus_testing.servers import NatsServer

pytestmark = pytest.mark.integration

MODEL = "scorer/v"  # a name that needs escaping in subjects
VERSION = "1.0.0"
POOL = "cpu-a"
ROW = 4  # FP32 values per row
_prefixes = itertools.count()


def config(**batching: Any) -> ModelConfig:
    max_batch_size = batching.pop("max_batch_size", 8)
    return ModelConfig(
        name=MODEL,
        max_batch_size=max_batch_size,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, ROW]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
        pool=POOL,
        batching=batching,
    )


@dataclass
class Answer:
    """One request's answer from a reply bundle, in the shape tests read."""

    headers: dict[str, str]
    data: bytes


class Harness:
    """One test's prefix, catalog entries, batcher and reply inbox."""

    def __init__(self, nc: Client, url: str) -> None:
        self.nc = nc
        self.url = url
        self.subjects = Subjects(f"bt{next(_prefixes)}")
        self.inbox = f"{self.subjects.prefix}.reply.test"
        self.replies: dict[str, Answer] = {}
        self._tokens = itertools.count(1_000_000)
        self._rids: dict[int, str] = {}
        self.reply_count = 0
        self.duplicates: list[str] = []
        self.bundle_replies: list[BundledReply] = []
        self.bundle_versions: list[str] = []
        self.old_form: list[nats.aio.msg.Msg] = []
        self._probed = asyncio.Event()
        self._got = asyncio.Event()

    async def deploy(self, cfg: ModelConfig) -> None:
        js = self.nc.jetstream()
        models = await ensure_kv(js, self.subjects.models_bucket)
        routes = await ensure_kv(js, self.subjects.routes_bucket)
        dv = DeployedVersion(model=MODEL, version=VERSION, config=cfg, digest="d" * 64)
        await models.put(self.subjects.model_key(MODEL, VERSION), dv.model_dump_json().encode())
        route = Route(model=MODEL, stable=VERSION, versions=[VERSION], pool=POOL)
        await routes.put(self.subjects.model_key(MODEL), route.model_dump_json().encode())

    def settings(self, **kw: Any) -> BatcherSettings:
        return BatcherSettings(
            nats_url=self.url,
            subject_prefix=self.subjects.prefix,
            instance_id="batcher-test",
            metrics_port=0,
            use_uvloop=False,
            drain_timeout_s=5,
            stream_max_bytes=8 << 20,
            **kw,
        )

    @asynccontextmanager
    async def batcher(self, **kw: Any) -> AsyncIterator[Batcher]:
        async def on_reply(msg: nats.aio.msg.Msg) -> None:
            if msg.subject == f"{self.inbox}.old":
                self.old_form.append(msg)
                self._got.set()
                return
            bundle = decode_reply_bundle(msg.data)
            for r in bundle.replies:
                rid = self._rids.get(r.token)
                if rid is None:  # sent with send_bundle
                    self.bundle_replies.append(r)
                    self.reply_count += 1
                    continue
                if rid.startswith("probe-"):
                    self._probed.set()
                    continue
                if rid in self.replies:
                    self.duplicates.append(rid)
                headers = {h.REQUEST_ID: rid, h.VERSION: bundle.version}
                if r.status:
                    headers.update({h.STATUS: r.status, h.ERROR: r.error, h.REASON: r.reason})
                self.replies[rid] = Answer(headers, bytes(r.frame))
                self.reply_count += 1
            self.bundle_versions.append(bundle.version)
            self._got.set()

        sub = await self.nc.subscribe(f"{self.inbox}.>", cb=on_reply)
        try:
            async with Batcher(self.settings(**kw)) as b:
                await self._probe()
                yield b
        finally:
            await sub.unsubscribe()

    async def _probe(self, timeout: float = 5.0) -> None:
        """Wait until the batcher demonstrably receives requests.

        nats-server (seen with 2.15.1) can fail to route the first message
        published right after a new subscription's SUB was flushed; a request
        for an undeployed model is answered NOT_FOUND once intake works.
        """
        async with asyncio.timeout(timeout):
            for k in itertools.count():
                await self.send(f"probe-{k}", b"", model="not-deployed")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await self._probed.wait()
                        return

    async def send(
        self,
        rid: str,
        payload: bytes,
        *,
        deadline_ns: int | None = None,
        model: str = MODEL,
        version: str = VERSION,
        priority: int | None = None,
    ) -> None:
        """One request, as a gateway sends it: a bundle of one (answers in `replies`)."""
        token = next(self._tokens)
        self._rids[token] = rid
        env = Envelope(
            rid,
            model,
            deadline_ns or 0,
            priority=priority or 0,
            traceparent=f"00-{'a' * 32}-{'b' * 16}-01",
        )
        await self.nc.publish(
            self.subjects.infer(model, version),
            encode_request_bundle(
                model, version, f"{self.inbox}.b", [BundledRequest(env, token)], [(payload,)]
            ),
        )

    async def send_bundle(
        self,
        requests: list[tuple[int, bytes]],
        *,
        deadline_ns: int | None = None,
        held_ns: int = 0,
        model: str = MODEL,
        version: str = VERSION,
    ) -> None:
        """One request bundle of (token, frame); replies come to ``<inbox>.b``."""
        deadline = deadline_ns if deadline_ns is not None else time.time_ns() + 30_000_000_000
        entries = [
            BundledRequest(Envelope(f"tok-{token}", model, deadline), token, held_ns)
            for token, _ in requests
        ]
        await self.nc.publish(
            self.subjects.infer(model, version),
            encode_request_bundle(
                model, version, f"{self.inbox}.b", entries, [(f,) for _, f in requests]
            ),
        )

    async def wait_replies(self, n: int, timeout: float = 5.0) -> None:
        try:
            async with asyncio.timeout(timeout):
                while self.reply_count < n:
                    self._got.clear()
                    await self._got.wait()
        except TimeoutError:
            raise AssertionError(
                f"{self.reply_count} of {n} replies arrived: {sorted(self.replies)}"
            ) from None
        assert self.duplicates == [], f"requests answered twice: {self.duplicates}"

    async def batches(self, want_entries: int, timeout: float = 5.0) -> list[MicroBatch]:
        """Pull micro-batches from the stream until `want_entries` entries arrived."""
        js = self.nc.jetstream()
        psub = await js.pull_subscribe(
            self.subjects.batch(POOL, MODEL, VERSION),
            durable=self.subjects.batch_consumer(POOL, MODEL, VERSION),
            stream=self.subjects.batch_stream,
            config=ConsumerConfig(ack_wait=30),
        )
        out: list[MicroBatch] = []
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < want_entries and time.monotonic() < deadline:
            try:
                msgs = await psub.fetch(16, timeout=0.5)
            except TimeoutError:  # nats' own and asyncio's (both subclass it)
                continue
            for m in msgs:
                assert m.headers[h.MODEL] == MODEL
                assert m.headers[h.VERSION] == VERSION
                assert m.headers[h.MSG_ID].startswith("batcher-test-")
                mb = decode_batch(m.data)
                out.append(mb)
                seen += len(mb.entries)
                await m.ack()
        await psub.unsubscribe()
        return out

    async def stream_msgs(self) -> int:
        info = await self.nc.jetstream().stream_info(self.subjects.batch_stream)
        return info.state.messages


def rows_payload(first: int, rows: int = 1) -> tuple[bytes, bytes]:
    """A tensor frame with `rows` rows whose values encode `first`; returns (frame, data)."""
    data = struct.pack(f"<{rows * ROW}f", *[float(first * 100 + i) for i in range(rows * ROW)])
    return encode_tensors([Tensor("x", "FP32", (rows, ROW), data)]), data


@pytest.fixture
async def harness(nats_client: Client, nats_server: NatsServer) -> Harness:
    return Harness(nats_client, nats_server.url)


async def test_concurrent_requests_become_micro_batches(harness: Harness) -> None:
    await harness.deploy(config(max_batch_size=8, max_queue_delay_us=20_000))
    sent: dict[str, bytes] = {}
    async with harness.batcher():
        payloads = []
        for i in range(64):
            rows = 2 if i % 8 == 0 else 1
            frame, data = rows_payload(i, rows)
            sent[f"req-{i}"] = data
            payloads.append((f"req-{i}", frame))
        await asyncio.gather(*(harness.send(rid, frame) for rid, frame in payloads))
        batches = await harness.batches(64)
    assert harness.replies == {}, "no request may be refused"
    got: dict[str, bytes] = {}
    for mb in batches:
        (x,) = mb.tensors
        assert x.name == "x"
        assert x.shape == (mb.rows, ROW)
        assert mb.rows <= 8
        row_bytes = ROW * 4
        offset = 0
        for e in mb.entries:
            assert e.request_id not in got, f"{e.request_id} is in two batches"
            got[e.request_id] = bytes(x.data[offset * row_bytes : (offset + e.rows) * row_bytes])
            assert e.reply == f"{harness.inbox}.b"
            assert harness._rids[e.token] == e.request_id
            assert e.traceparent.startswith("00-")
            # No deadline in the envelope: the model's default_timeout_ms (30 s) applies.
            assert e.deadline_ns - e.enqueued_ns == 30_000 * 1_000_000
            offset += e.rows
        assert offset == mb.rows
    assert got == sent
    assert any(mb.rows > 1 for mb in batches)
    assert len(batches) < 64


async def test_full_queue_answers_resource_exhausted(harness: Harness) -> None:
    await harness.deploy(config(max_batch_size=64, max_queue_delay_us=10_000_000, max_queue_size=4))
    frame, _ = rows_payload(1)
    labels = {"model": MODEL, "version": VERSION, "reason": "queue-full"}
    before = REGISTRY.get_sample_value("inferbus_batcher_rejections_total", labels) or 0.0
    async with harness.batcher():
        start = time.monotonic()
        for i in range(10):
            await harness.send(f"q-{i}", frame)
        await harness.wait_replies(6)
        elapsed = time.monotonic() - start
        assert elapsed < 2.0
        refused = sorted(harness.replies)
        assert refused == [f"q-{i}" for i in range(4, 10)]
        for msg in harness.replies.values():
            assert msg.headers[h.STATUS] == "RESOURCE_EXHAUSTED"
            assert msg.headers[h.REASON] == "queue-full"
            assert MODEL in msg.headers[h.ERROR]
            assert VERSION in msg.headers[h.ERROR]
            assert "max_queue_size 4" in msg.headers[h.ERROR]
        after = REGISTRY.get_sample_value("inferbus_batcher_rejections_total", labels)
        assert after == before + 6
    # Leaving the batcher flushed the four queued requests as a final batch.
    batches = await harness.batches(4)
    assert [[e.request_id for e in mb.entries] for mb in batches] == [[f"q-{i}" for i in range(4)]]


async def test_expired_requests_are_answered_and_never_batched(harness: Harness) -> None:
    await harness.deploy(config(max_batch_size=8, max_queue_delay_us=10_000_000))
    frame, _ = rows_payload(1)
    async with harness.batcher():
        await harness.send("late", frame, deadline_ns=time.time_ns() - 1_000_000)
        await harness.send("expires", frame, deadline_ns=time.time_ns() + 100_000_000)
        await harness.wait_replies(2)
        for rid in ("late", "expires"):
            assert harness.replies[rid].headers[h.STATUS] == "DEADLINE_EXCEEDED"
    assert await harness.stream_msgs() == 0


async def test_unknown_model_and_bad_body(harness: Harness) -> None:
    await harness.deploy(config())
    frame, _ = rows_payload(1)
    async with harness.batcher():
        await harness.send("nomodel", frame, model="nope")
        await harness.send("noversion", frame, version="9")
        await harness.send("garbage", b"not a frame")
        wrong = encode_tensors([Tensor("x", "FP32", (1, ROW + 1), bytes(4 * (ROW + 1)))])
        await harness.send("wrongshape", wrong)
        await harness.wait_replies(4)
    r = harness.replies
    assert r["nomodel"].headers[h.STATUS] == "NOT_FOUND"
    assert "'nope'" in r["nomodel"].headers[h.ERROR]
    assert r["noversion"].headers[h.STATUS] == "NOT_FOUND"
    assert r["garbage"].headers[h.STATUS] == "INVALID_ARGUMENT"
    assert r["wrongshape"].headers[h.STATUS] == "INVALID_ARGUMENT"
    assert all(m.headers[h.REQUEST_ID] == rid for rid, m in r.items())
    assert await harness.stream_msgs() == 0


async def test_the_old_single_request_form_is_refused_not_served(harness: Harness) -> None:
    """Headers and a bare tensor frame (the form before bundles): INVALID_ARGUMENT to
    the reply subject it names, nothing queued; a bundle for another model than its
    subject names is refused too."""
    await harness.deploy(config())
    frame, _ = rows_payload(1)
    async with harness.batcher():
        await harness.nc.publish(
            harness.subjects.infer(MODEL, VERSION),
            frame,
            headers={
                h.REQUEST_ID: "old",
                h.MODEL: MODEL,
                h.VERSION: VERSION,
                h.REPLY: f"{harness.inbox}.old",
            },
        )
        await harness.nc.publish(
            harness.subjects.infer(MODEL, VERSION),
            encode_request_bundle(
                "other",
                VERSION,
                f"{harness.inbox}.b",
                [BundledRequest(Envelope("x", "other", 0), 5)],
                [(frame,)],
            ),
        )
        await harness.wait_replies(1)
        async with asyncio.timeout(5):
            while not harness.old_form:
                harness._got.clear()
                await harness._got.wait()
    (msg,) = harness.old_form
    assert msg.headers[h.STATUS] == "INVALID_ARGUMENT"
    assert "request bundles (IBQ1) only" in msg.headers[h.ERROR]
    assert msg.headers[h.REQUEST_ID] == "old"
    assert [(r.token, r.status) for r in harness.bundle_replies] == [(5, "INVALID_ARGUMENT")]
    assert await harness.stream_msgs() == 0


async def test_full_work_queue_answers_each_request_once(harness: Harness) -> None:
    # A stream that holds one message and has no consumer: the second batch is refused.
    await harness.nc.jetstream().add_stream(
        StreamConfig(
            name=harness.subjects.batch_stream,
            subjects=[harness.subjects.batch_all],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.MEMORY,
            discard=DiscardPolicy.NEW,
            max_msgs=1,
        )
    )
    await harness.deploy(config(max_batch_size=2, max_queue_delay_us=0))
    frame, _ = rows_payload(1)
    async with harness.batcher():
        await harness.send("first", frame)
        await harness.send("second", frame)
        await harness.wait_replies(1)
    assert sorted(harness.replies) == ["second"]
    msg = harness.replies["second"]
    assert msg.headers[h.STATUS] == "RESOURCE_EXHAUSTED"
    assert msg.headers[h.REASON] == "work-queue-full"
    assert await harness.stream_msgs() == 1


async def test_priority_and_readiness(harness: Harness) -> None:
    await harness.deploy(
        config(
            max_batch_size=4, max_queue_delay_us=10_000_000, priority_levels=2, default_priority=2
        )
    )
    frame, _ = rows_payload(1)
    async with harness.batcher() as b:
        assert b.ready() == (True, "ok")
        for i in range(3):
            await harness.send(f"low-{i}", frame)
        await harness.send("high", frame, priority=1)
        batches = await harness.batches(4)
    assert [e.request_id for e in batches[0].entries] == ["high", "low-0", "low-1", "low-2"]
    assert b.ready()[0] is False


async def test_unbatched_model_publishes_each_request_alone(harness: Harness) -> None:
    cfg = ModelConfig(
        name=MODEL,
        max_batch_size=0,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [2, ROW]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [2, 1]}],
        pool=POOL,
        batching={"max_queue_delay_us": 10_000_000},
    )
    await harness.deploy(cfg)
    async with harness.batcher():
        for i in range(3):
            frame, _ = rows_payload(i, rows=2)
            await harness.send(f"u-{i}", frame)
        batches = await harness.batches(3)
    assert [[e.request_id for e in mb.entries] for mb in batches] == [["u-0"], ["u-1"], ["u-2"]]
    assert all(mb.tensors[0].shape == (2, ROW) and mb.rows == 2 for mb in batches)
    assert harness.replies == {}


async def test_idle_worker_signal_dispatches_without_waiting(harness: Harness) -> None:
    # A long queue delay: without an idle worker a lone request waits 2 s for company.
    await harness.deploy(config(max_batch_size=8, max_queue_delay_us=2_000_000))
    async with harness.batcher():
        frame, _ = rows_payload(1)
        await harness.send("first", frame)
        # A worker of the pool says it is idle: what waits goes at once.
        t0 = time.monotonic()
        await harness.nc.publish(harness.subjects.idle(POOL, MODEL, VERSION), b"")
        (batch,) = await harness.batches(1, timeout=1.5)
        assert time.monotonic() - t0 < 1.0
        assert [e.request_id for e in batch.entries] == ["first"]
        # One credit per signal: the next request waits for the delay again.
        await harness.send("second", frame)
        t1 = time.monotonic()
        (batch,) = await harness.batches(1, timeout=5)
        assert time.monotonic() - t1 > 1.0
        assert [e.request_id for e in batch.entries] == ["second"]


async def test_a_request_bundle_becomes_a_micro_batch_with_tokens(harness: Harness) -> None:
    await harness.deploy(config(max_batch_size=8, max_queue_delay_us=20_000))
    async with harness.batcher():
        sent = {}
        frames = []
        for token in range(1, 6):
            frame, data = rows_payload(token, 2 if token == 3 else 1)
            sent[token] = data
            frames.append((token, frame))
        # They waited 30 ms in the gateway's bundle: more than the 20 ms delay, so
        # the batcher sends them at once instead of waiting for more.
        await harness.send_bundle(frames, held_ns=30_000_000)
        batches = await harness.batches(5, timeout=2.0)
    assert harness.replies == {} and harness.bundle_replies == []
    assert len(batches) == 1
    (mb,) = batches
    assert [e.token for e in mb.entries] == [1, 2, 3, 4, 5]
    assert all(e.reply == f"{harness.inbox}.b" for e in mb.entries)
    (x,) = mb.tensors
    assert x.shape == (6, ROW)
    assert bytes(x.data) == b"".join(sent[t] for t in range(1, 6))


async def test_refusals_of_a_bundle_come_back_in_one_reply_bundle(harness: Harness) -> None:
    await harness.deploy(config(max_batch_size=64, max_queue_delay_us=10_000_000, max_queue_size=2))
    frame, _ = rows_payload(1)
    async with harness.batcher():
        # Not deployed: every request of the bundle, one reply bundle.
        await harness.send_bundle([(1, frame), (2, frame)], version="9.9.9")
        await harness.wait_replies(2)
        assert [(r.token, r.status) for r in harness.bundle_replies] == [
            (1, "NOT_FOUND"),
            (2, "NOT_FOUND"),
        ]
        assert "9.9.9" in harness.bundle_replies[0].error
        # Expired on arrival, and a queue bound of 2: the first two wait, the rest is refused.
        await harness.send_bundle([(3, frame)], deadline_ns=time.time_ns() - 1)
        await harness.send_bundle([(4, frame), (5, frame), (6, frame), (7, frame)])
        await harness.wait_replies(5)
        got = {r.token: r for r in harness.bundle_replies[2:]}
        assert sorted(got) == [3, 6, 7]
        assert got[3].status == "DEADLINE_EXCEEDED"
        assert (got[6].status, got[6].reason) == ("RESOURCE_EXHAUSTED", "queue-full")
        assert got[7].reason == "queue-full"
        # Garbage is dropped (nobody to answer) and the batcher keeps serving.
        await harness.nc.publish(harness.subjects.infer(MODEL, VERSION), b"IBQ1\x00")
        await harness.send_bundle([(8, frame)], version="9.9.9")
        await harness.wait_replies(6)
        assert harness.bundle_replies[-1].token == 8
