"""Gateway settings (env prefix ``INFERBUS_GATEWAY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
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
    audit_enabled: bool = True
    """Publish one audit record per answered request on ``<prefix>.audit.<model>``
    (read by the rollout controller, health-aware routing and the audit stream)."""
    server_name: str = "inferbus"
    """Name reported by ServerMetadata."""

    # --- admission control (inferbus_gateway.admission) ---------------------------
    redis_key_prefix: str = Field(default="ib", pattern=r"^[A-Za-z0-9_.-]+$")
    """First part of every admission key in Redis (``<prefix>:auth:keys``, ``<prefix>:limits``)."""
    redis_timeout_s: float = Field(default=0.25, gt=0, le=5)
    """Connect/socket timeout of the admission Redis client; past it, the failure mode applies."""
    auth_enabled: bool = False
    """Require an API key or JWT on every request. When false, every caller is tenant
    'anonymous' with access to every model, and a loud warning is logged at start."""
    auth_cache_ttl_s: float = Field(default=1.0, ge=0, le=1)
    """How long an API-key lookup or access list is reused; bounds how late a revocation applies."""
    auth_tenant_models: dict[str, list[str]] = Field(default_factory=dict)
    """Access lists from configuration (JSON: ``{"acme": ["fraud", "churn"], "ops": ["*"]}``),
    added to the Redis sets ``<prefix>:auth:models:<tenant>``."""
    auth_jwt_algorithms: list[str] = Field(default_factory=lambda: ["HS256", "RS256", "ES256"])
    """JWT ``alg`` values accepted (``none`` never is)."""
    auth_jwt_hs_secret: SecretStr | None = None
    """Shared secret for HS256 tokens; unset: HMAC tokens are refused."""
    auth_jwt_public_key_file: Path | None = None
    """PEM public key for RS256/ES256 tokens."""
    auth_jwt_jwks_file: Path | None = None
    """JWKS file (``{"keys": [...]}``) for RS256/ES256 tokens, keys chosen by ``kid``."""
    auth_jwt_audience: str = ""
    """Required ``aud`` claim (empty: tokens must not carry one)."""
    auth_jwt_issuer: str = ""
    """Required ``iss`` claim (empty: not checked)."""
    auth_jwt_tenant_claim: str = "tenant"
    """Claim that names the caller's tenant."""
    auth_jwt_leeway_s: float = Field(default=0.0, ge=0, le=300)
    """Clock skew tolerated on ``exp`` and ``nbf``."""
    ratelimit_failure_mode: Literal["fail-open", "fail-closed"] = "fail-open"
    """When Redis is unreachable: ``fail-open`` enforces cluster limit / live gateways in
    each gateway (quotas admit uncounted); ``fail-closed`` answers UNAVAILABLE."""
    ratelimit_instance_qps: float = Field(default=0.0, ge=0)
    """Per-instance QPS limit (reason ``instance-qps``); 0 disables it."""
    ratelimit_instance_burst: float = Field(default=0.0, ge=0)
    """Capacity of the per-instance bucket; 0 = 5 % of the QPS (at least 1)."""
    ratelimit_lease_ttl_s: float = Field(default=0.2, gt=0, le=0.2)
    """How long tokens leased from Redis stay usable in this gateway."""
    ratelimit_reload_interval_s: float = Field(default=0.5, gt=0, le=1)
    """Heartbeat: limits reload, live-gateway count and Redis recovery check."""
    ratelimit_gateway_ttl_s: float = Field(default=3.0, gt=0)
    """A gateway whose heartbeat is older than this is not counted as live."""
    breaker_enabled: bool = True
    """Per-model circuit breakers."""
    breaker_window_s: float = Field(default=10.0, gt=0)
    """Sliding window of outcomes a breaker judges."""
    breaker_min_requests: int = Field(default=20, ge=1)
    """Outcomes needed in the window before a breaker may open."""
    breaker_failure_rate: float = Field(default=0.5, gt=0, le=1)
    """Share of failures (errors, timeouts) in the window that opens the breaker."""
    breaker_open_s: float = Field(default=5.0, gt=0)
    """Cool-down of an open breaker before it lets probes through."""
    breaker_half_open_probes: int = Field(default=3, ge=1)
    """Probe requests let through when half-open; all must succeed to close."""
