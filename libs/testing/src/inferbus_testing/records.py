"""Records as the services encode them (audit records, worker heartbeats), for tests
that feed their readers."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from inferbus_common.audit import encode_record
from inferbus_common.catalog import WorkerStatus
from inferbus_common.subjects import subject_token


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


def ready_heartbeat(
    model: str, versions: Iterable[str], *, worker_id: str = "", fresh_for_s: float = 600.0
) -> tuple[str, bytes]:
    """(key, value) of a workers-bucket heartbeat reporting `versions` of `model` ready.

    Stamped `fresh_for_s` into the future so it stays fresh for the whole test
    (routers send nothing to a canary or shadow that no live worker serves).
    """
    status = WorkerStatus(
        worker_id=worker_id or f"w-{model}",
        pool="default",
        models={f"{model}/{v}": "ready" for v in versions},
        ts_ms=int((time.time() + fresh_for_s) * 1000),
    )
    return subject_token(status.worker_id), status.model_dump_json().encode()
