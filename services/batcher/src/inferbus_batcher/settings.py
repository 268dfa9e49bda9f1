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
    """Storage of the micro-batch stream when the batcher creates it."""
    stream_max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """Size bound of the micro-batch stream."""
