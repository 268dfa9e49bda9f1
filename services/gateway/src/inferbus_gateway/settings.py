"""Gateway settings (env prefix ``INFERBUS_GATEWAY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from inferbus_common.secretfile import read_secret
from inferbus_common.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    """Settings of the gateway process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_GATEWAY_", extra="forbid")

    http_port: int = Field(default=8000, ge=0, le=65535)
    """KServe V2 REST (and OpenAI-compatible) HTTP port; 0 = any free port."""
    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """KServe V2 gRPC port; 0 = any free port."""
    metrics_port: int = Field(default=8002, ge=0, le=65535)
    """/metrics, /healthz, /readyz (always this process's own port)."""
    port_group: Literal["off", "first", "join"] = "off"
    """Share the HTTP and gRPC ports with other gateway processes (SO_REUSEPORT).

    ``off``: bind them alone (a taken port fails). ``first``: the first process
    of a group: it test-binds both ports without SO_REUSEPORT (so a port some
    other process holds still fails loudly), then binds them with it. ``join``:
    a further process of the group: binds with SO_REUSEPORT straight away
    (start it only once the first one is up). The kernel spreads new
    connections over the processes; one connection stays with one process.
    """
    metrics_group: str | None = None
    """Glob of the ports files of this host's gateway processes, for ``/metrics/group``
    on the metrics port (every process's metrics, labelled ``gateway_process``).
    Unset: ``<dir of ports_file>/gateway*.json`` when `port_group` is not ``off``;
    ``/metrics/group`` is not served without either."""
    default_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline for requests that bring none and whose model sets none."""
    generation_max_timeout_s: float = Field(default=120.0, gt=0)
    """Longest deadline of a generative request (OpenAI endpoints) that brings none:
    the model's ``generation.default_timeout_ms``, capped at this."""
    generation_chunk_frames: bool = True
    """Ask LLM workers to frame the chunks of one engine step for all of this
    gateway's streams into one message (``Ib-Chunk-Frames``) instead of one
    message per stream and step; false: one message per chunk."""
    max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest request accepted (gRPC message or HTTP body)."""
    redis_url: str = ""
    """Redis for cluster-wide limits and quotas; empty disables them."""
    redis_password: SecretStr | None = None
    """Redis password (AUTH), when not in the URL; prefer `redis_password_file`."""
    redis_password_file: Path | None = None
    """File holding the Redis password (e.g. a mounted secret)."""
    tls_cert_file: Path | None = None
    """PEM certificate (chain) for gRPC and HTTP; with `tls_key_file`, both serve TLS only."""
    tls_key_file: Path | None = None
    """PEM private key of `tls_cert_file`."""
    tls_client_ca_file: Path | None = None
    """CA bundle of client certificates; when set, clients must present one (mutual TLS)."""
    idempotency_window_s: float = Field(default=30.0, ge=0)
    """A retry with the same request id and inputs within this window gets the
    first answer instead of being computed again (0 disables)."""
    audit_enabled: bool = True
    """Publish one audit record per answered request on ``<prefix>.audit.<model>``
    (read by the rollout controller, health-aware routing and the audit stream)."""
    audit_batch_ms: float = Field(default=20.0, ge=0)
    """Audit records of one model are published together, one message at most every
    this many ms (one record per line); 0 publishes each record as its own message."""
    stack_id: str = ""
    """The stack this gateway belongs to (``inferbus up`` sets it): ServerMetadata
    refuses a client that expects another (`inferbus_common.stackid`)."""
    server_name: str = "inferbus"
    """Name reported by ServerMetadata (``INFERBUS_GATEWAY_SERVER_NAME``; Triton's
    health/metadata example clients expect ``triton``)."""
    stream_max_in_flight: int = Field(default=256, ge=1)
    """Requests of one ModelStreamInfer stream being served at once; the stream is
    read no further until one finishes (gRPC flow control then holds the client)."""
    edge_calls: bool = True
    """Answer the unary KServe V2 calls that the gRPC edge (``inferbus-edge``,
    services/edge) carries over NATS on ``<prefix>.edge.grpc`` (queue group
    ``gateway``). Costs nothing while no edge runs."""
    edge_max_in_flight: int = Field(default=1024, ge=1)
    """Edge calls this process serves at once; more wait on the bus."""
    edge_reply_frames: bool = True
    """Answer an edge that asks for it with reply frames: the answers ready at one
    moment for one edge go out as one NATS message (a bundle's calls come back
    together). False: each answer on its call's own reply subject."""
    system_shared_memory: bool = True
    """Serve Triton's system shared-memory extension: clients on this host may name
    POSIX shared-memory regions (``/dev/shm``) for tensors. False refuses to register
    any region."""
    shared_memory_max_regions: int = Field(default=1024, ge=1)
    """Most system shared-memory regions registered at once (all tenants)."""
    settings_tenants: list[str] = Field(default_factory=list)
    """With authentication on, the tenants that may change the gateway's trace and
    log settings (Triton's trace and logging extensions; JSON list in the
    environment). Empty: nobody may. Without authentication anyone may, as in
    Triton without restricted APIs."""
    registry_url: str = ""
    """Registry gRPC ``host:port`` for Triton's model repository extension
    (``/v2/repository/...``, RepositoryIndex/Load/Unload); empty: those calls
    answer UNAVAILABLE."""
    registry_token_file: Path | None = None
    """File holding the registry's admin token (repository load/unload change what is
    served), when the registry requires one."""
    repository_load_timeout_s: float = Field(default=60.0, gt=0)
    """How long a repository load waits for a worker to report the model ready."""
    lazy_load_max_wait_s: float = Field(default=30.0, ge=0)
    """Longest a request for a ``load_policy: lazy`` version waits for its load (also
    capped at half the request's deadline) before UNAVAILABLE "loading, retry"."""

    # --- audit stream, payload capture, drift (capture.py, drift.py) --------------
    audit_stream_max_age_s: float = Field(default=7 * 24 * 3600.0, ge=0)
    """Retention of the audit stream (``<PREFIX>_AUDIT``) by age; 0 = no age limit."""
    audit_stream_max_bytes: int = Field(default=1 << 30, ge=-1)
    """Size bound of the audit stream; the oldest records go first (-1 = none)."""
    audit_stream_storage: Literal["file", "memory"] = "file"
    """Where NATS keeps the audit stream."""
    capture_rate: float = Field(default=0.0, ge=0, le=1)
    """Fraction of answered requests whose input and output tensors are captured into
    the audit stream (``<prefix>.audit.payload.<model>.<version>``) for ``inferbus replay``;
    0 disables capture."""
    capture_models: list[str] = Field(default_factory=list)
    """Capture only these models (JSON list; empty: every model)."""
    capture_max_bytes: int = Field(default=512 * 1024, ge=1024)
    """Requests whose inputs and outputs together are larger are not captured."""
    drift_sample_rate: float = Field(default=0.0, ge=0, le=1)
    """Fraction of answered requests of versions with a ``profile.json`` sampled into the
    drift windows; 0 disables drift detection."""
    drift_window_rows: int = Field(default=5000, ge=10)
    """Rows kept per model/version/tensor in the sliding drift window."""
    drift_min_rows: int = Field(default=200, ge=1)
    """No drift statistic is computed over fewer rows."""
    drift_interval_s: float = Field(default=15.0, gt=0)
    """How often PSI and KS are recomputed (off the request path)."""
    access_log: bool = True
    """One JSON line per inference request at INFO (logger ``inferbus_gateway.access``):
    request id, trace id, model, version, tenant, latency, status. Never headers or tensors."""
    direct_dispatch: bool = True
    """Send requests whose version the gateway decides itself (a pin, or a route with no
    canary taking traffic; `inferbus_common.resolver`) on a route without a shadow
    straight to that version's batchers, skipping the
    router hop (``inferbus_gateway.dispatch.plain.plain_version``; what it saves:
    docs/architecture.md, step 2). Off: every request goes through the router (its
    metrics and spans then count all traffic)."""

    fast_lane: bool = True
    """On direct dispatch, send a lone request (nothing else in flight here) to the
    version's idle workers over core NATS first (the fast lane; a busy worker refuses
    and the request goes through the batcher at once; docs/architecture.md)."""
    fast_lane_retry_s: float = Field(default=0.5, gt=0)
    """A fast-lane request with neither an answer nor a worker keep-alive this long is
    sent again the normal way (same request, first answer kept): a killed worker."""
    fast_lane_max_in_flight: int = Field(default=1, ge=1)
    """The fast lane applies while at most this many requests are in flight here, or
    while at most ``fast_lane_per_slot`` per execution slot of the version are."""
    fast_lane_per_slot: int = Field(default=2, ge=0)
    """The fast lane also applies while at most this many requests per execution slot
    of the version (its ready workers' ``instance_count``, summed) are in flight here:
    two keep a slot busy (one running, one on the wire). 0: only
    ``fast_lane_max_in_flight`` counts."""

    bundle_busy_cpu: float = Field(default=0.9, ge=0.0, le=2.0)
    """Busy share of the machine's CPUs (or of the cgroup's CPU quota), or of the
    gateway's own event-loop thread, whichever is higher (read every 100 ms, averaged),
    from which on CPU counts as what limits (and down to which, less 0.1, it stays so).
    Then a new bundle collects requests for ``bundle_window_us`` (fewer, fuller
    messages: less CPU per request) when other requests are in flight; otherwise a
    bundle holds what arrives in one event-loop turn and no request waits. 0: always
    collect; above 1: never."""
    bundle_per_slot: int = Field(default=2, ge=0)
    """A new bundle on a plain route also collects requests while this gateway has at
    least this many sent bundles per execution slot of its version (ready workers ×
    ``instance_count``) not yet answered: two keep each slot busy, one batch running
    and one on the wire; more would only queue downstream. It goes when one of them
    is answered (``bundle_release_on_reply``), after ``bundle_window_us`` at most, or
    when full. 0: only the CPU rule (``bundle_busy_cpu``) makes bundles wait."""
    bundle_deep_per_slot: int = Field(default=4, ge=0)
    """From this many requests per execution slot of the version in flight at this
    gateway, one sent bundle per slot (instead of ``bundle_per_slot``) makes a new
    bundle wait: with that many requests waiting, fuller batches gain more than a
    second batch on the wire keeps a slot busy. 0: off."""
    bundle_hold_by: Literal["bundles", "requests"] = "bundles"
    """What ``bundle_per_slot`` counts: sent bundles not yet answered, or (the rule
    before round 16, for comparison) requests in flight here."""
    bundle_release_on_reply: bool = True
    """A bundle held by ``bundle_per_slot`` goes as soon as one of this gateway's sent
    bundles of the same subject is fully answered (an execution slot finished a batch),
    unless CPU is short then (``bundle_busy_cpu``: fuller bundles help more), instead
    of at the end of ``bundle_window_us``. False: always the window."""
    bundle_window_us: int = Field(default=6000, ge=0, le=1_000_000)
    """How long a bundle collects requests at most while CPU is short
    (``bundle_busy_cpu``) or requests queue downstream (``bundle_per_slot``)."""
    bundle_max_requests: int = Field(default=256, ge=1, le=65535)
    """A bundle is sent as soon as it holds this many requests."""

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
    no_worker_grace_s: float = Field(default=0.0, ge=0)
    """A request for a version no live worker serves is answered UNAVAILABLE ("no
    live worker") at once, unless the version lost its last worker less than this
    long ago and the request's deadline reaches past the end of this grace: it then
    waits for a worker until the grace ends (a restart that may come back in time).
    0: always answer at once. Also applies to requests already sent to the version."""
    worker_probe_interval_s: float = Field(default=0.25, ge=0)
    """How often each worker is probed on its liveness subject: nats-server answers
    "no responders" for a worker whose connection closed, so a crashed worker is
    known within about this long (0: off; crashes are then known when the heartbeat
    goes stale, 15 s)."""
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

    def redis_secret(self) -> str | None:
        """The Redis password from `redis_password_file` or `redis_password` (None: none).

        Raises:
            OSError: the password file cannot be read.
        """
        return read_secret(
            self.redis_password.get_secret_value() if self.redis_password else None,
            self.redis_password_file,
        )
