"""Row bookkeeping of micro-batches: expiry, gathering inputs, splitting replies."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inferbus_common import bus
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import ReplyBundle, decode_reply_bundle
from inferbus_common.protocol.microbatch import (
    BatchEntry,
    MicroBatch,
    decode_batch,
    encode_joined_batch,
)
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.validation import RequestChecker
from inferbus_worker.microbatch import (
    BatchReplies,
    LiveRequest,
    Outbox,
    ReplyContext,
    gather_inputs,
    split_expired,
)

NOW = 1_000_000_000_000


def _batch(rows: list[int], deadlines: list[int]) -> tuple[MicroBatch, np.ndarray]:
    x = np.arange(sum(rows) * 64, dtype=np.float32).reshape(sum(rows), 64)
    entries = [
        BatchEntry(f"r{i}", f"reply.{i}", d, NOW - 1000, n, token=i + 1)
        for i, (n, d) in enumerate(zip(rows, deadlines, strict=True))
    ]
    # Round-trip through the wire format so the tensors are zero-copy views, as in the worker.
    return decode_batch(encode_joined_batch(entries, [[tensor_from_numpy("input", x)]])), x


def test_split_expired_zero_means_no_deadline() -> None:
    batch, _ = _batch([1, 2, 1], [0, NOW - 1, NOW + 1])
    assert split_expired(batch, NOW) == ([0, 2], [1])


def test_all_live_is_zero_copy(fraud_config: ModelConfig) -> None:
    batch, x = _batch([2, 3], [0, 0])
    inputs, requests = gather_inputs(fraud_config, batch, [0, 1])
    assert not inputs["input"].flags.owndata
    np.testing.assert_array_equal(inputs["input"], x)
    assert [(r.start, r.stop) for r in requests] == [(0, 2), (2, 5)]


def test_contiguous_live_rows_are_a_slice(fraud_config: ModelConfig) -> None:
    batch, x = _batch([2, 3, 1], [NOW - 1, 0, 0])
    inputs, requests = gather_inputs(fraud_config, batch, [1, 2])
    assert not inputs["input"].flags.owndata
    np.testing.assert_array_equal(inputs["input"], x[2:6])
    assert [(r.entry.request_id, r.start, r.stop) for r in requests] == [("r1", 0, 3), ("r2", 3, 4)]


def test_holes_are_left_out(fraud_config: ModelConfig) -> None:
    batch, x = _batch([2, 3, 1], [0, NOW - 1, 0])
    inputs, requests = gather_inputs(fraud_config, batch, [0, 2])
    np.testing.assert_array_equal(inputs["input"], np.concatenate([x[0:2], x[5:6]]))
    assert [(r.start, r.stop) for r in requests] == [(0, 2), (2, 3)]


def test_rows_must_add_up(fraud_config: ModelConfig) -> None:
    x = np.zeros((3, 64), np.float32)
    batch = decode_batch(
        encode_joined_batch([BatchEntry("a", "r", 0, 0, 2)], [[tensor_from_numpy("input", x)]])
    )
    with pytest.raises(InvalidArgument, match="claim 2"):
        gather_inputs(fraud_config, batch, [0])


@pytest.mark.parametrize("checked", [False, True])
def test_wrong_tensor_is_invalid(fraud_config: ModelConfig, checked: bool) -> None:
    # With a checker that has seen a good layout, a bad one is still refused.
    checker = RequestChecker(fraud_config) if checked else None
    good, _ = _batch([1], [0])
    gather_inputs(fraud_config, good, [0], checker)
    x = np.zeros((1, 63), np.float32)
    batch = decode_batch(
        encode_joined_batch([BatchEntry("a", "r", 0, 0, 1)], [[tensor_from_numpy("input", x)]])
    )
    with pytest.raises(InvalidArgument, match=r"input 'input' has shape \[1, 63\]"):
        gather_inputs(fraud_config, batch, [0], checker)


def _frame(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


async def test_an_outbox_answers_in_one_reply_bundle_per_inbox(
    fraud_config: ModelConfig, nats_client
) -> None:
    batch, _ = _batch([2, 3], [0, 0])
    _, requests = gather_inputs(fraud_config, batch, [0, 1])
    probs = np.arange(10, dtype=np.float32).reshape(5, 2)
    replies = BatchReplies({"probabilities": probs}, batched=True, compute_ms=0.25)
    outbox = Outbox(ReplyContext("1", "sha256:abc"), replies.shared_timings, 5)
    first, second = (r.entry for r in requests)
    second.mirror, second.mirror_token = "shadow.pb", 77
    outbox.ok(first, 1.5, replies.frame_parts(requests[0]))
    outbox.ok(second, 2.5, replies.frame_parts(requests[1]))
    outbox.error(BatchEntry("c", "gw.b", 0, 0, 1, token=9), StatusCode.INTERNAL, "bad\n index")
    assert outbox.counts == {"OK": 2, "INTERNAL": 1} and len(outbox) == 3
    sent: dict[str, list[ReplyBundle]] = {}
    four = asyncio.Event()

    async def on_msg(msg) -> None:
        sent.setdefault(msg.subject, []).append(decode_reply_bundle(msg.data))
        if sum(map(len, sent.values())) >= 4:
            four.set()

    sub = await nats_client.subscribe("*.*", cb=on_msg)
    await bus.sync(nats_client)
    await outbox.send(nats_client)
    await bus.sync(nats_client)
    await asyncio.wait_for(four.wait(), 10)
    await sub.unsubscribe()
    # One reply bundle per inbox.
    assert {k: len(v) for k, v in sent.items()} == {
        "gw.b": 1,
        "reply.0": 1,
        "reply.1": 1,
        "shadow.pb": 1,
    }
    one = sent["reply.1"][0]
    assert (one.version, one.digest, one.batch_rows) == ("1", "sha256:abc", 5)
    assert h.parse_timings(one.timings) == {"compute": 0.25}
    (reply,) = one.replies
    assert (reply.token, reply.status, reply.queue_ms) == (second.token, "", 2.5)
    (tensor,) = decode_tensors(bytes(reply.frame))
    np.testing.assert_array_equal(tensor.as_numpy(), probs[2:5])
    # The mirror copy is the same answer under the mirror's token.
    (mirrored,) = sent["shadow.pb"][0].replies
    assert mirrored.token == 77 and bytes(mirrored.frame) == bytes(reply.frame)
    (failed,) = sent["gw.b"][0].replies
    assert (failed.token, failed.status, failed.error) == (9, "INTERNAL", "bad index")


def test_unknown_output_is_invalid(fraud_config: ModelConfig) -> None:
    x = np.zeros((1, 64), np.float32)
    entry = BatchEntry("a", "r", 0, 0, 1, ("nope",), token=1)
    batch = decode_batch(encode_joined_batch([entry], [[tensor_from_numpy("input", x)]]))
    _, requests = gather_inputs(fraud_config, batch, [0])
    replies = BatchReplies(
        {"probabilities": np.zeros((1, 2), np.float32)}, batched=True, compute_ms=0
    )
    with pytest.raises(InvalidArgument, match=r"unknown output\(s\) \['nope'\]"):
        replies.frame_parts(requests[0])


def test_batch_replies_slice_each_request_and_share_timings(fraud_config: ModelConfig) -> None:
    batch, _ = _batch([1, 2, 1], [0, 0, 0])
    _, requests = gather_inputs(fraud_config, batch, [0, 1, 2])
    outputs = {
        "probabilities": np.arange(8, dtype=np.float32).reshape(4, 2),
        "label": np.arange(4, dtype=np.int64),
    }
    requests[2].entry.outputs = ("label",)
    stages = {"pre": 0.0125, "post": 2.0}
    replies = BatchReplies(outputs, batched=True, compute_ms=0.25, stages_ms=stages)
    assert replies.shared_timings == h.format_timings({"compute": 0.25, **stages})
    for r in requests:
        tensors = {t.name: t.as_numpy() for t in decode_tensors(_frame(replies.frame_parts(r)))}
        wanted = r.entry.outputs or tuple(outputs)
        assert list(tensors) == list(wanted)
        for name in wanted:
            np.testing.assert_array_equal(tensors[name], outputs[name][r.start : r.stop])


def test_unbatched_replies_hold_whole_outputs() -> None:
    entry = BatchEntry("a", "r", 0, 0, 1, token=1)
    out = {"y": np.arange(6, dtype=np.float32).reshape(2, 3)}
    replies = BatchReplies(out, batched=False, compute_ms=1)
    (t,) = decode_tensors(_frame(replies.frame_parts(LiveRequest(entry, 0))))
    np.testing.assert_array_equal(t.as_numpy(), out["y"])
