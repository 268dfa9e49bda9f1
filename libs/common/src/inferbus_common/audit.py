"""The audit record: one per request the gateway answered.

The gateway publishes the records as JSON on ``<prefix>.audit.<model>``
(`Subjects.audit`), a batch at a time: one message carries one or more
records of the model, one JSON object per line (`split_records`; a message
with one record is that record's JSON, as before batching). Consumers: the
audit stream (``<prefix>_AUDIT``), the rollout controller (error rate and
latency per version), health-aware routing, replay and drift tools.
Publishing is fire-and-forget: the audit trail never slows down or fails a
request.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
from pydantic import BaseModel, Field


class AuditRecord(BaseModel):
    """What happened to one request."""

    request_id: str
    ts_unix_ms: int
    """When the gateway answered."""
    gateway: str = ""
    """Instance id of the gateway that answered."""
    protocol: str = ""
    """``grpc``, ``rest`` or ``openai``."""
    tenant: str = ""
    model: str
    version: str = ""
    """Version that answered ('' when none was reached)."""
    digest: str = ""
    """SHA-256 of the answering version's manifest."""
    status: str
    """`StatusCode` name (``OK``, ``INVALID_ARGUMENT``, ...) or ``DEGRADED``."""
    reason: str = ""
    """Machine-readable refusal reason (``cluster-qps``, ``breaker-open``, ...)."""
    latency_ms: float = 0.0
    """End-to-end time at the gateway."""
    stages_ms: dict[str, float] = Field(default_factory=dict)
    """Stage timings from the reply (``queue``, ``compute``, ``gateway``, ...)."""


def encode_record(
    *,
    request_id: str,
    ts_unix_ms: int,
    gateway: str,
    protocol: str,
    tenant: str,
    model: str,
    version: str,
    digest: str,
    status: str,
    reason: str,
    latency_ms: float,
    stages_ms: dict[str, float],
) -> bytes:
    """JSON bytes of an `AuditRecord`, without pydantic's cost on the hot path (orjson)."""
    return orjson.dumps(
        {
            "request_id": request_id,
            "ts_unix_ms": ts_unix_ms,
            "gateway": gateway,
            "protocol": protocol,
            "tenant": tenant,
            "model": model,
            "version": version,
            "digest": digest,
            "status": status,
            "reason": reason,
            "latency_ms": round(latency_ms, 3),
            "stages_ms": {k: round(v, 3) for k, v in stages_ms.items()},
        }
    )


def decode_record(data: bytes) -> AuditRecord:
    """Parse a published record.

    Raises:
        pydantic.ValidationError: not an audit record.
    """
    return AuditRecord.model_validate_json(data)


def split_records(data: bytes) -> Iterator[bytes]:
    """The records of one audit message, each a JSON object (blank lines skipped)."""
    if b"\n" not in data:
        if data:
            yield data
        return
    for line in data.split(b"\n"):
        if line:
            yield line


def decode_records(data: bytes) -> list[AuditRecord]:
    """Parse every record of one audit message.

    Raises:
        pydantic.ValidationError: a line is not an audit record.
    """
    return [decode_record(line) for line in split_records(data)]
