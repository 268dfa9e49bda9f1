"""Settings every service shares. Each service subclasses `ServiceSettings`
with its own env prefix (``INFERBUS_GATEWAY_`` ...); settings are built once
in `main`, checked before anything is served, and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """Fields common to all services."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL (comma-separate several for a cluster)."""
    subject_prefix: str = Field(default="ib", pattern=r"^[A-Za-z0-9_-]+$")
    """First token of every subject, stream and bucket name."""
    instance_id: str = ""
    """Unique name of this process; generated from host and pid when empty."""
    host: str = "127.0.0.1"
    """Address the service's listeners bind to."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of /metrics, /healthz and /readyz (0 = any free port)."""
    ports_file: Path | None = None
    """When set, the bound ports are written here as JSON once serving."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Lowest level logged."""
    log_format: Literal["json", "text"] = "json"
    """JSON lines for machines, text for people."""
    use_uvloop: bool = True
    """Run the event loop on uvloop (faster) instead of asyncio's default."""
    drain_timeout_s: float = Field(default=10.0, ge=0)
    """On SIGTERM, how long to finish in-flight work before exiting."""
