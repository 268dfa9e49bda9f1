"""Captured payloads: the binary format and the audit stream they are kept in (real NATS)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, RetentionPolicy

from inferbus_common.audittrail import ensure_audit_stream, read_captures
from inferbus_common.capture import decode_capture, encode_capture
from inferbus_common.codec import Tensor, serialize_bytes, tensor_from_numpy
from inferbus_common.protocol.framing import FrameError
from inferbus_common.subjects import Subjects


def _capture(request_id: str, version: str = "1", value: float = 0.0) -> bytes:
    x = np.full((1, 4), value, dtype=np.float32)
    y = np.array([[1, 2]], dtype=np.int64)
    return encode_capture(
        request_id=request_id,
        model="fraud",
        version=version,
        digest="d" * 64,
        ts_unix_ms=123,
        tenant="acme",
        requested_outputs=["y"],
        inputs=[tensor_from_numpy("x", x)],
        outputs=[tensor_from_numpy("y", y)],
    )


def test_capture_round_trips_tensors_and_metadata() -> None:
    words = Tensor("w", "BYTES", (2,), serialize_bytes([b"a", b"bc"]))
    body = encode_capture(
        request_id="r1",
        model="m",
        version="2",
        digest="abc",
        ts_unix_ms=5,
        tenant="t",
        requested_outputs=[],
        inputs=[tensor_from_numpy("x", np.arange(6, dtype=np.float32).reshape(2, 3)), words],
        outputs=[tensor_from_numpy("y", np.array([1.5, 2.5], dtype=np.float64))],
    )
    cap = decode_capture(body)
    assert (cap.request_id, cap.model, cap.version, cap.digest, cap.tenant) == (
        "r1",
        "m",
        "2",
        "abc",
        "t",
    )
    assert [t.name for t in cap.inputs] == ["x", "w"]
    assert cap.inputs[0].as_numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert bytes(cap.inputs[1].data) == bytes(words.data)
    assert cap.outputs[0].as_numpy().tolist() == [1.5, 2.5]


def test_decode_refuses_what_is_not_a_capture() -> None:
    with pytest.raises(FrameError, match="bad magic"):
        decode_capture(b'{"request_id": "r"}')
    with pytest.raises(FrameError):
        decode_capture(_capture("r")[:40])


async def test_audit_stream_is_idempotent_and_discards_old(nats_client: Client) -> None:
    subjects = Subjects("ib")
    js = nats_client.jetstream()
    await ensure_audit_stream(js, subjects, max_age_s=3600, max_bytes=64 * 1024)
    await ensure_audit_stream(js, subjects, max_age_s=3600, max_bytes=64 * 1024)
    info = await js.stream_info(subjects.audit_stream)
    assert info.config.subjects == ["ib.audit.>"]
    assert info.config.retention == RetentionPolicy.LIMITS
    assert info.config.discard == DiscardPolicy.OLD
    # New limits are applied to the existing stream.
    await ensure_audit_stream(js, subjects, max_age_s=60, max_bytes=32 * 1024)
    info = await js.stream_info(subjects.audit_stream)
    assert info.config.max_age == pytest.approx(60)
    assert info.config.max_bytes == 32 * 1024
    # Full: publishes still succeed, the oldest messages go.
    for i in range(200):
        ack = await js.publish(subjects.audit("fraud"), b"x" * 512 + str(i).encode())
        assert ack.seq == i + 1
    info = await js.stream_info(subjects.audit_stream)
    assert info.state.bytes <= 32 * 1024
    assert info.state.first_seq > 1


async def test_read_captures_filters_by_version_time_and_limit(nats_client: Client) -> None:
    subjects = Subjects("ib")
    js = nats_client.jetstream()
    await ensure_audit_stream(js, subjects, max_age_s=3600, max_bytes=1 << 24)
    for i in range(5):
        await js.publish(subjects.audit_payload("fraud", "1"), _capture(f"a{i}", "1", float(i)))
        await js.publish(subjects.audit_payload("fraud", "2"), _capture(f"b{i}", "2"))
    await js.publish(subjects.audit("fraud"), b'{"not": "a capture"}')
    got = [
        c.request_id
        async for c in read_captures(js, subjects, "fraud", "1", since_unix_s=time.time() - 60)
    ]
    assert got == [f"a{i}" for i in range(5)]
    limited = [
        c.request_id
        async for c in read_captures(
            js, subjects, "fraud", "2", since_unix_s=time.time() - 60, limit=3
        )
    ]
    assert limited == ["b0", "b1", "b2"]
    future = [
        c
        async for c in read_captures(
            js, subjects, "fraud", "1", since_unix_s=time.time() + 60, fetch_timeout_s=0.5
        )
    ]
    assert future == []
