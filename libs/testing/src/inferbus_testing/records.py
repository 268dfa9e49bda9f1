"""Audit records as the gateway encodes them, for tests that feed their readers."""

from __future__ import annotations

from collections.abc import Mapping

from inferbus_common.audit import encode_record


def audit_record(
    model: str,
    version: str = "1",
    status: str = "OK",
    *,
    request_id: str = "r",
    latency_ms: float = 1.0,
    ts_unix_ms: int = 0,
    gateway: str = "g",
    tenant: str = "",
    stages_ms: Mapping[str, float] | None = None,
) -> bytes:
    """One encoded `AuditRecord` (`inferbus_common.audit.encode_record`) over gRPC."""
    return encode_record(
        request_id=request_id,
        ts_unix_ms=ts_unix_ms,
        gateway=gateway,
        protocol="grpc",
        tenant=tenant,
        model=model,
        version=version,
        digest="",
        status=status,
        reason="",
        latency_ms=latency_ms,
        stages_ms=dict(stages_ms or {}),
    )
