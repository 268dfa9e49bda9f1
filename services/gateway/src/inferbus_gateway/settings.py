"""Gateway settings (env prefix ``INFERBUS_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    """Settings of the gateway process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_GATEWAY_", extra="forbid")

    http_port: int = Field(default=8000, ge=0, le=65535)
    """KServe V2 REST (and OpenAI-compatible) HTTP port; 0 = any free port."""
    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """KServe V2 gRPC port; 0 = any free port."""
    metrics_port: int = Field(default=8002, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    default_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline for requests that bring none and whose model sets none."""
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest request accepted (gRPC message or HTTP body)."""
    redis_url: str = ""
    """Redis for cluster-wide limits and quotas; empty disables them."""
    idempotency_window_s: float = Field(default=30.0, ge=0)
    """A retry with the same request id and inputs within this window gets the
    first answer instead of being computed again (0 disables)."""
    server_name: str = "inferbus"
    """Name reported by ServerMetadata."""
