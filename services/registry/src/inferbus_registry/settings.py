"""Registry settings (env prefix ``INFERBUS_REGISTRY_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings


class RegistrySettings(ServiceSettings):
    """Settings of the registry process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_REGISTRY_", extra="forbid")

    grpc_port: int = Field(default=8070, ge=0, le=65535)
    """Registry gRPC API port; 0 = any free port."""
    metrics_port: int = Field(default=8042, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    store: Literal["local", "s3"] = "local"
    """Where artifacts live: a local directory or an S3 endpoint (MinIO)."""
    store_dir: Path = Path("~/.local/share/inferbus/models")
    """Root of the local store."""
    s3_endpoint: str = "127.0.0.1:9000"
    """S3 endpoint host:port (MinIO or any S3-compatible server)."""
    s3_access_key: str = ""
    """S3 access key."""
    s3_secret_key: str = ""
    """S3 secret key (prefer `s3_secret_key_file`)."""
    s3_secret_key_file: Path | None = None
    """File holding the S3 secret key (a compose or Kubernetes secret); wins over
    `s3_secret_key`."""
    s3_bucket: str = "inferbus"
    """Bucket holding `models/<name>/<version>/...`."""
    s3_secure: bool = False
    """Use HTTPS to reach the S3 endpoint."""
    signing_key_file: Path | None = None
    """Ed25519 private key (PEM) that signs every pushed version; unset: unsigned.
    Workers that trust its public key refuse anything else."""
    signing_key_id: str = "registry"
    """Name of the signing key, recorded with each signature (for key rotation)."""
    trusted_keys: list[str] = Field(default_factory=list)
    """Public keys (``<key_id>=<base64>``, JSON list in the environment) whose signatures
    the registry accepts when it checks a version before traffic moves to it, besides
    its own signing key's (keys rotated out, another registry's)."""
    promotion_timeout_s: float = Field(default=300.0, gt=0)
    """How long the previous ``stable`` keeps serving while a newly promoted version
    loads; past it (or as soon as a worker refuses the new version for good) the
    promotion is abandoned and ``stable`` moves back (make-before-break)."""
    stack_id: str = ""
    """The stack this registry belongs to (``inferbus up`` sets it): a call that
    expects another stack is refused (`inferbus_common.stackid`)."""
    admin_token: SecretStr | None = None
    """Token required for every registry call (prefer `admin_token_file`); with
    neither token set the API is open (see docs/security.md)."""
    admin_token_file: Path | None = None
    """File holding the admin token."""
    reader_token: SecretStr | None = None
    """Token allowed only read calls (list, get, download, route/rollout/pool reads):
    give it to workers and read-only tools (prefer `reader_token_file`)."""
    reader_token_file: Path | None = None
    """File holding the reader token."""
    s3_region: str = "us-east-1"
    """S3 region name."""
    spool_dir: Path | None = None
    """Where pushed files wait while being checked (default: the system temp dir).
    It needs room for the largest push."""
    convert_pickles: bool = True
    """Convert a pushed ``model.pkl``/``model.joblib`` (scikit-learn, LightGBM) to ONNX
    in a sandboxed child process (docs/security.md: unpickling runs code, so only
    those allowed to push should be trusted with it); false: such a push is refused."""
    convert_timeout_s: float = Field(default=300.0, gt=0)
    """Wall-clock limit of one conversion; past it the child's process group is killed."""
    convert_memory_mb: int = Field(default=4096, ge=256)
    """Address-space limit of the conversion child (RLIMIT_AS), in MiB."""
    convert_concurrency: int = Field(default=2, ge=1)
    """Conversions running at once (each a child process); more pickle pushes wait."""
    convert_tolerance: float = Field(default=1e-4, ge=0)
    """Largest absolute difference allowed between the pickle's and the ONNX model's
    probabilities (or predictions) on the check sample; more refuses the push."""
    max_push_bytes: int = Field(default=16 << 30, ge=1)
    """A push sending more bytes than this is refused with INVALID_ARGUMENT."""
    grpc_max_message_bytes: int = Field(default=64 << 20, ge=16 << 20)
    """Largest gRPC message sent or received (at least 16 MiB)."""
    rollout_tick_s: float = Field(default=0.5, gt=0)
    """How often the rollout controller judges active rollouts (a step's interval is
    measured to within this)."""
    store_probe_interval_s: float = Field(default=10.0, gt=0)
    """How often the store's reachability (for /readyz) and NATS reconnects (to republish
    the catalog) are checked."""
