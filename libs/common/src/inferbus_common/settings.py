"""Settings every service shares. Each service subclasses `ServiceSettings`
with its own env prefix (``INFERBUS_GATEWAY_`` ...); settings are built once
in `main`, checked before anything is served, and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypedDict

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from inferbus_common.secretfile import read_secret


class NatsAuth(TypedDict, total=False):
    """Keyword arguments of `inferbus_common.bus.connect` taken from the settings."""

    user_credentials: str
    user: str
    password: str
    tls_ca_file: str
    jetstream_replicas: int


class ServiceSettings(BaseSettings):
    """Fields common to all services."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL; the nodes of a cluster separated by commas
    (``nats://n1:4222,nats://n2:4222,nats://n3:4222``): the service starts at
    any of them and moves to another when its node goes away."""
    jetstream_replicas: int = Field(default=1, ge=1, le=5)
    """Replicas of the JetStream streams and KV buckets this service creates
    (work queue, audit stream, catalog buckets): 1 on a single nats-server, 3 on
    a three-node cluster, so that each survives the loss of a node. At most the
    cluster's size. Existing ones keep theirs, except that the work-queue and
    audit streams are raised to it."""
    nats_user: str = ""
    """NATS user (see `inferbus_common.security`); empty: connect without a user."""
    nats_password: SecretStr | None = None
    """Password of `nats_user` (prefer `nats_password_file`)."""
    nats_password_file: Path | None = None
    """File holding the password of `nats_user` (e.g. a mounted secret)."""
    nats_creds_file: Path | None = None
    """NATS credentials file (NKEY seed + user JWT), instead of user and password."""
    nats_tls_ca_file: Path | None = None
    """CA bundle to verify a ``tls://`` NATS server (system CAs when unset)."""
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
    gc_thresholds: tuple[int, int, int] = (50_000, 10, 10)
    """Python's cyclic collector thresholds (``gc.set_threshold``). The default
    (700, 10, 10) runs a full collection every ~0.2 s at a few thousand requests a
    second, a pause of milliseconds each time: at concurrency 64 these gave 1.07x
    requests/s and 0.79x p99 (bench/findings.md, round 7). Request objects hold no
    reference cycles that need collecting promptly."""
    drain_timeout_s: float = Field(default=10.0, ge=0)
    """On SIGTERM, how long to finish in-flight work before exiting."""

    # --- tracing (inferbus_common.tracing) -----------------------------------------
    tracing_enabled: bool = False
    """Record OpenTelemetry spans. Off by default: the W3C ``traceparent`` is still
    passed along unchanged, so turning it on in one service never breaks another."""
    tracing_sample_ratio: float = Field(default=0.01, ge=0, le=1)
    """Share of requests without a sampled client ``traceparent`` that are traced
    (parent-based: a client's sampling decision is always followed). Only the
    gateway starts traces; the other services follow the request's flag."""
    tracing_exporter: Literal["otlp", "console", "none"] = "otlp"
    """Where spans go: ``otlp`` (gRPC to `tracing_otlp_endpoint`), ``console``
    (stdout, for debugging) or ``none`` (spans are built and dropped)."""
    tracing_otlp_endpoint: str = "http://127.0.0.1:4317"
    """OTLP/gRPC collector address (``https://`` for TLS)."""
    tracing_export_interval_ms: int = Field(default=2000, ge=10, le=60_000)
    """How long finished spans wait to be exported in one batch."""
    tracing_max_queue: int = Field(default=8192, ge=64)
    """Finished spans buffered for export; past it, spans are dropped (never blocks)."""

    def nats_auth(self) -> NatsAuth:
        """Keyword arguments for `inferbus_common.bus.connect`: credentials, inbox,
        TLS, and the JetStream replica count when it is not 1.

        Raises:
            OSError: a password file that cannot be read.
        """
        out: NatsAuth = {}
        if self.nats_creds_file is not None:
            out["user_credentials"] = str(self.nats_creds_file)
        if self.nats_user:
            out["user"] = self.nats_user
            if self.nats_password_file is not None or self.nats_password is not None:
                # Even an empty password is sent: nats-py sends the user only with one.
                out["password"] = (
                    read_secret(
                        self.nats_password.get_secret_value() if self.nats_password else None,
                        self.nats_password_file,
                    )
                    or ""
                )
        if self.nats_tls_ca_file is not None:
            out["tls_ca_file"] = str(self.nats_tls_ca_file)
        if self.jetstream_replicas != 1:
            out["jetstream_replicas"] = self.jetstream_replicas
        return out
