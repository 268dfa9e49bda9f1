"""Router settings (env prefix ``INFERBUS_ROUTER_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings


class RouterSettings(ServiceSettings):
    """Settings of the router process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_ROUTER_", extra="forbid")

    metrics_port: int = Field(default=8012, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    queue_group: str = "router"
    """NATS queue group shared by all router instances."""
