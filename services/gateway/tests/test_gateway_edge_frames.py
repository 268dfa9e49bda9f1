"""Reply frames: a gateway's answers to the gRPC edge's calls, gathered.

The layout is the edge's (services/edge/replies.go); here the gateway's frames
are read back from a real nats-server as the edge reads them. The edge itself against
real gateways: tests/e2e/test_e2e_edge.py.
"""

from __future__ import annotations

import asyncio
import struct
import time

import grpc

from inferbus_gateway.grpc_api.edge import (
    CLAIM_EVERY_S,
    METHOD,
    RECORD,
    REPLY_FRAMES,
    EdgeContext,
    EdgeListener,
    ReplyFrames,
    _call_id,
    pack_answer,
)
from inferbus_gateway.grpc_api.tolerant import SERVICE
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb


def read_answers(data: bytes) -> list[tuple[int, int, str, bytes]]:
    """A reply frame's records, as the edge's parseFrame reads them."""
    out, at = [], 0
    while at < len(data):
        call_id, code, meta_len, body_len = RECORD.unpack_from(data, at)
        at += RECORD.size
        meta = data[at : at + meta_len].decode()
        body = data[at + meta_len : at + meta_len + body_len]
        out.append((call_id, code, meta, body))
        at += meta_len + body_len
    return out


def test_an_answer_record_carries_status_message_and_trailers() -> None:
    ok = EdgeContext({}, None, "")
    assert pack_answer(3, ok, b"resp") == RECORD.pack(3, 0, 0, 4) + b"resp"
    refused = EdgeContext({}, None, "")
    refused.code = grpc.StatusCode.RESOURCE_EXHAUSTED
    refused.details = "over the limit\nof tenant a"
    refused.set_trailing_metadata([("retry-after", "2"), ("inferbus-reason", "rate")])
    [(call_id, code, meta, body)] = read_answers(pack_answer(4, refused, b""))
    assert (call_id, code, body) == (4, 8, b"")
    assert meta.split("\n") == [
        "over the limit of tenant a",
        "retry-after:2",
        "inferbus-reason:rate",
    ]


async def test_answers_ready_in_one_loop_turn_leave_as_one_frame(nats_client) -> None:
    got: list[bytes] = []
    arrived = asyncio.Event()

    async def on(msg) -> None:
        got.append(msg.data)
        arrived.set()

    await nats_client.subscribe("_INBOX.edge1.r", cb=on)
    frames = ReplyFrames(nats_client)
    ok = EdgeContext({}, None, "")
    for call_id in (1, 2, 3):
        frames.add("_INBOX.edge1.r", call_id, ok, f"answer {call_id}".encode())
    await frames.flushed(5)
    await nats_client.flush()
    await asyncio.wait_for(arrived.wait(), 5)
    await asyncio.sleep(0.05)
    assert len(got) == 1
    assert [(r[0], r[3]) for r in read_answers(got[0])] == [
        (1, b"answer 1"),
        (2, b"answer 2"),
        (3, b"answer 3"),
    ]

    # A later turn starts a new frame.
    got.clear()
    arrived.clear()
    frames.add("_INBOX.edge1.r", 4, ok, b"answer 4")
    await frames.flushed(5)
    await asyncio.wait_for(arrived.wait(), 5)
    assert [r[0] for r in read_answers(got[0])] == [4]


async def test_frames_stay_under_max_payload_and_an_answer_too_large_is_refused(
    nats_client,
) -> None:
    got: list[bytes] = []

    async def on(msg) -> None:
        got.append(msg.data)

    await nats_client.subscribe("_INBOX.edge2.r", cb=on)
    frames = ReplyFrames(nats_client)
    limit = nats_client.max_payload - 1024
    ok = EdgeContext({}, None, "")
    big = b"x" * (limit // 2)
    for call_id in (1, 2, 3):  # two do not fit in one frame with the third
        frames.add("_INBOX.edge2.r", call_id, ok, big)
    frames.add("_INBOX.edge2.r", 4, ok, b"x" * (limit + 1))
    await frames.flushed(5)
    await nats_client.flush()
    for _ in range(100):
        if sum(len(read_answers(g)) for g in got) == 4:
            break
        await asyncio.sleep(0.02)
    assert all(len(g) <= nats_client.max_payload for g in got)
    records = [r for g in got for r in read_answers(g)]
    assert [r[0] for r in records] == [1, 2, 3, 4]
    too_big = records[3]
    assert too_big[1] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "more than the bus carries" in too_big[2] and too_big[3] == b""


class _HeldServicer:
    """Every unary method waits for `release`, then answers ServerLive's response."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def __getattr__(self, name: str):
        async def handler(request, context):
            await self.release.wait()
            return pb.ServerLiveResponse(live=True)

        return handler


async def test_a_gateway_claims_the_calls_it_holds_until_it_answers_them(nats_client) -> None:
    """The edge answers UNAVAILABLE a call no gateway claims (services/edge/replies.go):
    the gateway claims, every CLAIM_EVERY_S, the calls it has held longer than that."""
    claims: list[tuple[float, list[int]]] = []
    frames: list[bytes] = []

    async def on(msg) -> None:
        if msg.subject.endswith(".k"):
            claims.append(
                (time.monotonic(), list(struct.unpack(f"<{len(msg.data) // 8}Q", msg.data)))
            )
        elif msg.subject.endswith(".r"):
            frames.append(msg.data)

    await nats_client.subscribe("_INBOX.edgeT.>", cb=on)
    servicer = _HeldServicer()
    listener = EdgeListener(nats_client, "t.edge.grpc", servicer, max_in_flight=8)
    await listener.start()
    try:
        sent = time.monotonic()
        for call_id in (7, 8):
            await nats_client.publish(
                "t.edge.grpc",
                b"",
                reply=f"_INBOX.edgeT.c.{call_id}",
                headers={METHOD: f"/{SERVICE}/ServerLive", REPLY_FRAMES: "_INBOX.edgeT.r"},
            )
        await asyncio.sleep(3 * CLAIM_EVERY_S + 0.1)
        assert claims, "no claim in three claim periods"
        assert all(sorted(ids) == [7, 8] for _, ids in claims), claims
        # Only calls held longer than a period are claimed: none before that.
        assert claims[0][0] - sent >= CLAIM_EVERY_S - 0.05
        servicer.release.set()
        for _ in range(50):
            if frames:
                break
            await asyncio.sleep(0.02)
        assert sorted(r[0] for f in frames for r in read_answers(f)) == [7, 8]
        answered = time.monotonic()
        await asyncio.sleep(2 * CLAIM_EVERY_S + 0.1)
        assert not [t for t, _ in claims if t > answered + 0.05], (
            "a call was claimed after its answer"
        )
    finally:
        await listener.stop(5)


def test_a_call_id_is_a_uint64_or_the_call_is_answered_on_its_own_subject() -> None:
    assert _call_id("_INBOX.e.c.42") == 42
    assert _call_id(f"_INBOX.e.c.{(1 << 64) - 1}") == (1 << 64) - 1
    # Past 64 bits a record (and a claim) could not carry it.
    assert _call_id(f"_INBOX.e.c.{1 << 64}") is None
    assert _call_id("_INBOX.e.c.9" * 3 + "9" * 40) is None
    assert _call_id("_INBOX.e.c.x1") is None
