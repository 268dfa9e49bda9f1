"""The records of the catalog buckets and the states of a version on a worker.

`DeployedVersion` (models bucket), `Route` (routes bucket), `WorkerStatus`
(workers bucket) and `PoolSpec` (pools bucket), as the registry and the workers
write them; `Catalog` (`inferbus_common.catalog`) keeps them in memory. The
version states a worker reports (`READY`, `FAILED`, `REJECTED`) and how they
read across workers (`summarize_states`) are here too.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from inferbus_common.errors import FailedPrecondition, InferbusError, Unavailable
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.modelstats import ModelStats


class DeployedVersion(BaseModel):
    """A model version the registry has stored and published."""

    model: str
    version: str
    config: ModelConfig
    digest: str = ""
    """SHA-256 of the version's manifest.json."""
    files: dict[str, str] = Field(default_factory=dict)
    """Path inside the version → SHA-256 of the file."""
    created_unix_ms: int = 0
    signature: str = ""
    """Base64 Ed25519 signature of `signing.signed_payload` (empty: unsigned)."""
    key_id: str = ""
    """Which registry key signed it."""
    number: int = 0
    """Triton-style integer number, unique within the model (`versionnumbers`;
    0: a record from before versions were numbered)."""

    @property
    def has_profile(self) -> bool:
        """The version carries a drift reference profile (``profile.json``, see `drift`)."""
        return "profile.json" in self.files


class Route(BaseModel):
    """Routing table of one model."""

    model: str
    stable: str
    """Version that serves requests that pin none."""
    versions: list[str] = Field(default_factory=list)
    aliases: dict[str, str] = Field(default_factory=dict)
    pool: str = "default"
    """Pool of the stable version (each version's own pool is its `config.pool`)."""
    canary: str = ""
    """Version that takes `canary_weight` percent of unpinned traffic ('' = none)."""
    canary_weight: float = 0.0
    """Percent (0-100) of unpinned requests sent to `canary`."""
    shadow: str = ""
    """Version that receives sampled copies of requests ('' = none); never answers clients."""
    shadow_rate: float = 0.0
    """Fraction (0-1) of requests copied to `shadow`."""
    sticky: str = ""
    """Stickiness key: '' (off), 'tenant', or 'header:<Name>' (a request header)."""
    revision: int = 0
    """Incremented by every change; routers log and export it."""
    updated_by: str = ""
    updated_unix_ms: int = 0
    change: str = ""
    """Why the last change was made (operator text or rollout step)."""
    stable_pending: str = ""
    """Version the ``stable`` alias was moved to while `stable` keeps serving until a
    worker reports it ready (make-before-break); '' when no promotion is pending.
    Workers load it like any routed version; nothing routes requests to it."""
    stable_pending_since_unix_ms: int = 0
    """When the pending promotion began (the registry abandons it after its timeout)."""

    def served_versions(self) -> set[str]:
        """Versions workers must load for this route: every version it names."""
        named = {self.stable, self.canary, self.shadow, self.stable_pending}
        named.update(self.aliases.values())
        named.discard("")
        return named


READY = "ready"
"""Version state: a worker serves it."""
FAILED = "failed: "
"""Prefix of the state of a version whose load failed and will be retried."""
REJECTED = "failed permanently: "
"""Prefix of the state of a version a worker refuses to load (its artifact failed its
digest or signature check, or its config cannot be served): retrying cannot help."""


def is_rejected(state: str) -> bool:
    """Whether a version state is a permanent load failure (see `REJECTED`)."""
    return state.startswith(REJECTED)


def not_ready_error(model: str, version: str, state: str) -> InferbusError:
    """The error a request for a version that is not ready gets.

    A version its workers refuse for good (`REJECTED`) is FAILED_PRECONDITION:
    retrying cannot help, the operator must fix or move the alias. Anything
    else (loading, a failure that is retried, no worker yet) is UNAVAILABLE.
    """
    where = f"model '{model}' version '{version}'"
    if is_rejected(state):
        return FailedPrecondition(
            f"{where} cannot be served: {state}; point the alias or route at another "
            "version (`inferbus models alias`, `inferbus route set`)"
        )
    return Unavailable(
        f"{where} is not ready ({state}); check `inferbus status` and the worker logs"
    )


class WorkerStatus(BaseModel):
    """A worker's heartbeat."""

    worker_id: str
    pool: str
    models: dict[str, str] = Field(default_factory=dict)
    """``"<model>/<version>"`` → ``ready`` | ``loading`` | ``lazy`` | ``failed: <reason>``
    | ``failed permanently: <reason>``."""
    ts_ms: int = 0
    """Wall-clock time of the heartbeat."""
    host: str = ""
    pid: int = 0
    cpus: int = 0
    """CPUs this worker may use (its affinity mask); 0 = unknown."""
    memory_bytes: int = 0
    """Memory available to it (cgroup limit, else the host's); 0 = unknown."""
    gpu_type: str = ""
    """GPU model name from NVML / nvidia-smi ('' = none)."""
    gpu_count: int = 0
    """GPUs visible to it (0 = none or unknown)."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """UUIDs of those GPUs (empty: unknown): pools count a GPU that several workers
    share once (`count_gpus`)."""
    joined_unix_ms: int = 0
    """When the worker started: pools admit workers in join order (oldest first)."""
    admitted: bool = True
    """False while its pool's quota keeps it out (it then serves nothing)."""
    reason: str = ""
    """Why it is not admitted ('' when admitted)."""
    stats: dict[str, ModelStats] = Field(default_factory=dict)
    """``"<model>/<version>"`` → cumulative inference statistics of the versions it
    serves (Triton's statistics extension sums them over live workers)."""
    alive_subject: str = ""
    """Subject the worker answers liveness probes on (`Subjects.alive`; '' = it does
    not, a worker from before them): gateways ask it to learn of a crash at once."""

    def is_fresh(self, max_age_s: float) -> bool:
        """Whether the heartbeat is recent enough to trust."""
        return (time.time() * 1000 - self.ts_ms) <= max_age_s * 1000


class PoolSpec(BaseModel):
    """A worker pool's quota and release state (the pools bucket, key = pool token)."""

    name: str
    max_workers: int = Field(default=0, ge=0)
    """Workers admitted at most (0 = unlimited); later joiners stay not-ready."""
    max_gpus: int = Field(default=0, ge=0)
    """Sum of admitted workers' GPUs at most (0 = unlimited)."""
    state: str = "open"
    """Release state: ``open`` or ``frozen`` (traffic changes and rollouts onto it refused)."""
    updated_by: str = ""
    updated_unix_ms: int = 0


POOL_STATES = ("open", "frozen")
"""Release states a pool can be in."""


def summarize_states(states: list[str]) -> str:
    """One version's state across workers: ``ready`` if any serves it, else a permanent
    failure, else a retried failure, else the first state; ``no worker`` without any."""
    if READY in states:
        return READY
    for prefix in (REJECTED, FAILED):
        found = [s for s in states if s.startswith(prefix)]
        if found:
            return found[0]
    return states[0] if states else "no worker"
