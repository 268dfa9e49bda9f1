"""Row bookkeeping of micro-batches: expiry, gathering inputs, splitting replies."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
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
    ReplyContext,
    error_reply,
    gather_inputs,
    ok_reply,
    split_expired,
)

NOW = 1_000_000_000_000


def _batch(rows: list[int], deadlines: list[int]) -> tuple[MicroBatch, np.ndarray]:
    x = np.arange(sum(rows) * 64, dtype=np.float32).reshape(sum(rows), 64)
    entries = [
        BatchEntry(f"r{i}", f"reply.{i}", d, NOW - 1000, n)
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


def test_ok_reply_has_rows_and_headers(fraud_config: ModelConfig) -> None:
    batch, _ = _batch([2, 3], [0, 0])
    _, requests = gather_inputs(fraud_config, batch, [0, 1])
    probs = np.arange(10, dtype=np.float32).reshape(5, 2)
    ctx = ReplyContext("1", "sha256:abc")
    headers, body = ok_reply(
        ctx,
        requests[1],
        {"probabilities": probs},
        batched=True,
        queue_ms=1.5,
        compute_ms=0.25,
        batch_rows=5,
    )
    assert headers[h.REQUEST_ID] == "r1"
    assert headers[h.VERSION] == "1"
    assert headers[h.DIGEST] == "sha256:abc"
    assert headers[h.BATCH_SIZE] == "5"
    assert h.parse_timings(headers[h.TIMINGS]) == {"queue": 1.5, "compute": 0.25}
    (tensor,) = decode_tensors(body)
    np.testing.assert_array_equal(tensor.as_numpy(), probs[2:5])


def test_unknown_output_is_invalid(fraud_config: ModelConfig) -> None:
    x = np.zeros((1, 64), np.float32)
    batch = decode_batch(
        encode_joined_batch(
            [BatchEntry("a", "r", 0, 0, 1, ("nope",))], [[tensor_from_numpy("input", x)]]
        )
    )
    _, requests = gather_inputs(fraud_config, batch, [0])
    with pytest.raises(InvalidArgument, match="nope"):
        ok_reply(
            ReplyContext("1", ""),
            requests[0],
            {"probabilities": np.zeros((1, 2), np.float32)},
            batched=True,
            queue_ms=0,
            compute_ms=0,
            batch_rows=1,
        )


def test_batch_replies_share_the_batch_and_time_each_request(fraud_config: ModelConfig) -> None:
    batch, _ = _batch([1, 2, 1], [0, 0, 0])
    _, requests = gather_inputs(fraud_config, batch, [0, 1, 2])
    outputs = {
        "probabilities": np.arange(8, dtype=np.float32).reshape(4, 2),
        "label": np.arange(4, dtype=np.int64),
    }
    requests[2].entry.outputs = ("label",)
    requests[1].entry.traceparent = "00-abc-def-01"
    ctx = ReplyContext("1", "sha256:abc")
    stages = {"pre": 0.0125, "post": 2.0}
    replies = BatchReplies(
        ctx, outputs, batched=True, compute_ms=0.25, batch_rows=4, stages_ms=stages
    )
    for i, r in enumerate(requests):
        headers, body = replies.ok(r, 0.5 + i)
        assert h.parse_timings(headers[h.TIMINGS]) == {
            "queue": 0.5 + i,
            "compute": 0.25,
            "pre": 0.013,
            "post": 2.0,
        }
        assert headers[h.TIMINGS] == h.format_timings({"queue": 0.5 + i, "compute": 0.25, **stages})
        assert headers[h.BATCH_SIZE] == "4"
        assert headers.get(h.TRACEPARENT) == ("00-abc-def-01" if i == 1 else None)
        tensors = {t.name: t.as_numpy() for t in decode_tensors(body)}
        wanted = r.entry.outputs or tuple(outputs)
        assert list(tensors) == list(wanted)
        for name in wanted:
            np.testing.assert_array_equal(tensors[name], outputs[name][r.start : r.stop])
    with pytest.raises(InvalidArgument, match=r"unknown output\(s\) \['nope'\]"):
        replies.ok(LiveRequest(BatchEntry("x", "r", 0, 0, 1, ("label", "nope")), 0), 0.0)


def test_unbatched_replies_hold_whole_outputs() -> None:
    entry = BatchEntry("a", "r", 0, 0, 1)
    out = {"y": np.arange(6, dtype=np.float32).reshape(2, 3)}
    replies = BatchReplies(ReplyContext("1", ""), out, batched=False, compute_ms=1, batch_rows=1)
    (t,) = decode_tensors(replies.ok(LiveRequest(entry, 0), 0.0)[1])
    np.testing.assert_array_equal(t.as_numpy(), out["y"])


def test_error_reply_flattens_the_message() -> None:
    entry = BatchEntry("a", "r", 0, 0, 1, (), "00-abc-def-01")
    headers, body = error_reply(
        ReplyContext("1", "d"), entry, StatusCode.INVALID_ARGUMENT, "bad\n index: 1\r\n"
    )
    assert body == b""
    assert headers[h.STATUS] == "INVALID_ARGUMENT"
    assert headers[h.ERROR] == "bad index: 1"
    assert headers[h.TRACEPARENT] == "00-abc-def-01"
