"""Reply frames: a gateway's answers to the gRPC edge's calls, gathered.

The layout is the edge's (services/edge/replies.go); here the gateway's frames
are read back from a real nats-server as the edge reads them. The edge itself against
real gateways: tests/e2e/test_e2e_edge.py.
"""

from __future__ import annotations

import asyncio

import grpc

from inferbus_gateway.grpc_api.edge import RECORD, EdgeContext, ReplyFrames, pack_answer


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
