"""Captured payloads: a request's input tensors and its answer, kept for replay.

With payload capture on, the gateway publishes one message per sampled
answered request on ``<prefix>.audit.payload.<model>`` (`Subjects.audit_payload`),
inside the audit stream but apart from the small JSON audit records. The body
carries both tensor frames exactly as the platform moves them (`wire`)::

    b"IBC1" | u32 meta_len | meta (JSON) | u64 inputs_len | inputs frame | outputs frame

meta = ``{"request_id", "model", "version", "digest", "ts_unix_ms", "tenant",
"outputs"}`` (``outputs``: the output names the client asked for, [] = all).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferbus_common.codec import Tensor
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.tensors import decode_tensors, encode_tensors

CAPTURE_MAGIC = b"IBC1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(slots=True)
class CapturedRequest:
    """One captured request and the answer it got."""

    request_id: str
    model: str
    version: str
    digest: str
    ts_unix_ms: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    tenant: str = ""
    requested_outputs: list[str] = field(default_factory=list)


def encode_capture(
    *,
    request_id: str,
    model: str,
    version: str,
    digest: str,
    ts_unix_ms: int,
    tenant: str,
    requested_outputs: Sequence[str],
    inputs: Sequence[Tensor],
    outputs: Sequence[Tensor],
) -> bytes:
    """The capture message body (see the module docstring)."""
    meta = json.dumps(
        {
            "request_id": request_id,
            "model": model,
            "version": version,
            "digest": digest,
            "ts_unix_ms": ts_unix_ms,
            "tenant": tenant,
            "outputs": list(requested_outputs),
        },
        separators=(",", ":"),
    ).encode()
    frame_in = encode_tensors(inputs)
    frame_out = encode_tensors(outputs)
    return b"".join(
        [CAPTURE_MAGIC, _U32.pack(len(meta)), meta, _U64.pack(len(frame_in)), frame_in, frame_out]
    )


def decode_capture(data: bytes | memoryview) -> CapturedRequest:
    """Parse a capture message.

    Raises:
        FrameError: not a capture message, or a truncated one.
    """
    view = memoryview(data)
    if bytes(view[:4]) != CAPTURE_MAGIC:
        raise FrameError("not an inferbus capture message (bad magic)")
    try:
        (meta_len,) = _U32.unpack_from(view, 4)
        offset = 8
        meta = json.loads(bytes(view[offset : offset + meta_len]))
        offset += meta_len
        (in_len,) = _U64.unpack_from(view, offset)
        offset += 8
        if offset + in_len > len(view):
            raise FrameError("capture message is truncated")
        inputs = decode_tensors(view[offset : offset + in_len])
        outputs = decode_tensors(view[offset + in_len :])
        return CapturedRequest(
            request_id=str(meta["request_id"]),
            model=str(meta["model"]),
            version=str(meta.get("version", "")),
            digest=str(meta.get("digest", "")),
            ts_unix_ms=int(meta.get("ts_unix_ms", 0)),
            tenant=str(meta.get("tenant", "")),
            requested_outputs=[str(o) for o in meta.get("outputs", [])],
            inputs=inputs,
            outputs=outputs,
        )
    except FrameError:
        raise
    except (struct.error, KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"malformed capture message: {exc}") from None
