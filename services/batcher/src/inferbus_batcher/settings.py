"""Batcher settings (env prefix ``INFERBUS_BATCHER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings


class BatcherSettings(ServiceSettings):
    """Settings of the batcher process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_BATCHER_", extra="forbid")

    metrics_port: int = Field(default=8022, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    queue_group: str = "batcher"
    """NATS queue group shared by all batcher instances."""
    stream_storage: Literal["memory", "file"] = "memory"
    """Storage of the micro-batch stream when the batcher creates it (a stream that
    exists with other storage is kept, and the mismatch logged: it cannot change
    in place)."""
    stream_max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """Size bound of the micro-batch stream (set on the stream at every start)."""
    stream_max_msgs_per_subject: int = Field(default=1024, ge=1)
    """Micro-batches one pool/model/version may have waiting in the stream; beyond
    it the batcher answers RESOURCE_EXHAUSTED (``work-queue-full``). Set on the
    stream at every start, also when a worker created it first."""
    max_outstanding_publishes: int = Field(default=64, ge=1)
    """Micro-batch publishes awaiting their JetStream ack at once; beyond it,
    ready batches wait in their queue (which then fills and answers
    RESOURCE_EXHAUSTED)."""
    publish_timeout_s: float = Field(default=2.0, gt=0)
    """How long one publish waits for its JetStream ack."""
    publish_attempts: int = Field(default=3, ge=1)
    """Publishes of one micro-batch before giving up on timeouts; retries
    reuse the `Nats-Msg-Id`, so JetStream stores the batch at most once."""
    pending_msgs_limit: int = Field(default=65_536, ge=1)
    """Incoming requests buffered by the NATS client before it drops (slow consumer)."""
    pending_bytes_limit: int = Field(default=256 * 1024 * 1024, ge=1 << 20)
    """Bytes of incoming requests buffered by the NATS client."""
