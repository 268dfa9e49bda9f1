"""Request and reply bundles, and IBB3 micro-batches (entries with inboxes and tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol.bundles import (
    BundledReply,
    BundledRequest,
    ReplyGroups,
    decode_reply_bundle,
    decode_request_bundle,
    encode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.microbatch import (
    BatchEntry,
    decode_batch,
    encode_joined_batch,
)
from inferbus_common.protocol.tensors import (
    decode_tensors,
    encode_tensors,
    join_tensors,
    tensor_frame_parts,
)


def _tensors(rows: int, start: float = 0.0):
    x = np.arange(start, start + rows * 3, dtype=np.float32).reshape(rows, 3)
    words = np.array([f"w{i}" * (i + 1) for i in range(rows)], dtype=object)
    return [tensor_from_numpy("x", x), tensor_from_numpy("s", words)]


def test_request_bundle_round_trip_keeps_every_field_and_frame() -> None:
    reqs = [
        BundledRequest(
            Envelope("r-7", "m", 123, "canary", 2, ("y", "z"), "00-tp", "acme", "k1"), 7, 100
        ),
        BundledRequest(
            Envelope("r-8", "m", 456), 8, mirror="ib.reply.r.shadow.pb", mirror_token=99
        ),
    ]
    groups = [_tensors(2), _tensors(3, 100.0)]
    data = encode_request_bundle(
        "m", "3", "ib.reply.gw.b", reqs, [tensor_frame_parts(g) for g in groups]
    )
    with pytest.raises(FrameError, match="bad magic"):
        decode_request_bundle(encode_tensors(groups[0]))
    bundle = decode_request_bundle(data)
    assert (bundle.model, bundle.version, bundle.inbox) == ("m", "3", "ib.reply.gw.b")
    for got, want, tensors in zip(bundle.requests, reqs, groups, strict=True):
        frame = bytes(got.frame)
        got.frame = want.frame = b""
        assert got == want
        assert frame == encode_tensors(tensors)
        decoded = decode_tensors(frame)
        assert decoded[1].as_numpy().tolist() == tensors[1].as_numpy().tolist()


def test_a_forwarded_bundle_reuses_the_received_frames() -> None:
    reqs = [BundledRequest(Envelope(f"r{i}", "m", 1), i) for i in range(3)]
    groups = [_tensors(1, float(i)) for i in range(3)]
    first = decode_request_bundle(
        encode_request_bundle("m", "", "in.b", reqs, [tensor_frame_parts(g) for g in groups])
    )
    again = encode_request_bundle(
        "m", "2", first.inbox, first.requests[1:], [(r.frame,) for r in first.requests[1:]]
    )
    second = decode_request_bundle(again)
    assert [r.token for r in second.requests] == [1, 2]
    assert [bytes(r.frame) for r in second.requests] == [encode_tensors(g) for g in groups[1:]]


@pytest.mark.parametrize("cut", [3, 10, 40, -1])
def test_truncated_bundles_are_frame_errors(cut: int) -> None:
    data = encode_request_bundle(
        "m",
        "1",
        "in.b",
        [BundledRequest(Envelope("r", "m", 1), 1)],
        [tensor_frame_parts(_tensors(1))],
    )
    with pytest.raises(FrameError):
        decode_request_bundle(data[:cut])
    reply = encode_reply_bundle("1", "d", "", 1, [BundledReply(1)], [(b"abcd",)])
    with pytest.raises(FrameError):
        decode_reply_bundle(reply[:cut])
    with pytest.raises(FrameError):
        decode_request_bundle(data + b"x")


def test_reply_bundle_round_trip_with_errors_and_frames() -> None:
    frame = encode_tensors(_tensors(1))
    replies = [
        BundledReply(1, queue_ms=0.25),
        BundledReply(2, "RESOURCE_EXHAUSTED", "queue\nfull  now", "queue-full"),
    ]
    data = encode_reply_bundle("3", "sha", "compute=0.100", 5, replies, [(frame,), ()])
    bundle = decode_reply_bundle(data)
    assert (bundle.version, bundle.digest, bundle.timings, bundle.batch_rows) == (
        "3",
        "sha",
        "compute=0.100",
        5,
    )
    assert bytes(bundle.replies[0].frame) == frame
    assert bundle.replies[0].queue_ms == pytest.approx(0.25)
    assert (bundle.replies[1].status, bundle.replies[1].reason) == (
        "RESOURCE_EXHAUSTED",
        "queue-full",
    )
    # Messages for people lose their line breaks (`framing.one_line`).
    assert bundle.replies[1].error == "queue full now"
    assert bytes(bundle.replies[1].frame) == b""


def test_reply_groups_make_one_bundle_per_inbox() -> None:
    groups = ReplyGroups("1", "d", "compute=1.000", 4)
    groups.add("gw1.b", BundledReply(1), (b"a",))
    groups.add("gw2.b", BundledReply(5, "INTERNAL", "boom"))
    groups.add("gw1.b", BundledReply(2), (b"b", b"c"))
    assert len(groups) == 3
    out = dict(groups.messages())
    assert sorted(out) == ["gw1.b", "gw2.b"]
    gw1 = decode_reply_bundle(out["gw1.b"])
    assert [(r.token, bytes(r.frame)) for r in gw1.replies] == [(1, b"a"), (2, b"bc")]
    assert decode_reply_bundle(out["gw2.b"]).replies[0].status == "INTERNAL"


def test_ibb3_carries_inboxes_once_and_tokens_per_entry() -> None:
    tensors = [tensor_from_numpy("x", np.arange(8, dtype=np.float32).reshape(4, 2))]
    entries = [
        BatchEntry("a", "ib.reply.gw1.b", 10, 1, 1, token=1),
        BatchEntry("b", "ib.reply.gw2.b", 20, 2, 2, ("y",), "tp", token=9),
        BatchEntry(
            "c", "ib.reply.gw1.b", 30, 3, 1, mirror="ib.reply.r.shadow.pb", token=2, mirror_token=77
        ),
    ]
    data = encode_joined_batch(entries, [tensors])
    assert data[:4] == b"IBB3"
    assert data.count(b"ib.reply.gw1.b") == 1
    batch = decode_batch(data)
    assert batch.entries == entries
    assert batch.tensors[0].as_numpy().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # An entry nobody waits for (no inbox) round-trips as such.
    mixed = [BatchEntry("p", "", 1, 1, 1, token=3), entries[0]]
    both = [join_tensors([tensors, tensors])]
    assert decode_batch(encode_joined_batch(mixed, both)).entries == mixed


def test_a_micro_batch_in_another_format_is_refused() -> None:
    """IBB3 is the only micro-batch format: the old IBB1/IBB2 magic is a FrameError."""
    for magic in (b"IBB1", b"IBB2", b"IBT1"):
        with pytest.raises(FrameError, match="bad magic"):
            decode_batch(magic + b"\x01\x00\x00\x00")


def test_joined_batch_is_one_copy_of_the_same_bytes() -> None:
    entries = [BatchEntry(f"r{i}", f"s.{i}", 0, 0, i + 1, token=i + 1) for i in range(3)]
    groups = [_tensors(i + 1, 10.0 * i) for i in range(3)]
    assert encode_joined_batch(entries, groups) == encode_joined_batch(
        entries, [join_tensors(groups)]
    )
    batch = decode_batch(encode_joined_batch(entries, groups))
    assert batch.tensors[0].shape == (6, 3)
    assert batch.tensors[1].as_numpy().tolist() == [
        w for g in groups for w in g[1].as_numpy().tolist()
    ]
