"""Worker settings (env prefix ``INFERBUS_WORKER_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings
from inferbus_worker.scriptpool import ScriptLimits


class WorkerSettings(ServiceSettings):
    """Settings of a worker process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_WORKER_", extra="forbid")

    metrics_port: int = Field(default=8032, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    pool: str = "default"
    """Worker pool this worker belongs to; it serves versions placed on it."""
    registry_url: str = "127.0.0.1:8070"
    """Registry gRPC address (artifacts are downloaded from it)."""
    registry_token_file: Path | None = None
    """File holding the registry's reader token, when the registry requires one."""
    cache_dir: Path = Path("~/.cache/inferbus/artifacts")
    """Local artifact cache."""
    cache_max_bytes: int = Field(default=0, ge=0)
    """Bound of the artifact cache in bytes (0 = unbounded). Versions not loaded
    are evicted least recently used first; a loaded version never is."""
    trusted_keys: list[str] = Field(default_factory=list)
    """Registry public keys this worker trusts, ``<key_id>=<base64>`` (JSON list in
    the environment). When set, only versions signed by one of them are loaded;
    several keys allow rotation."""
    unload_grace_s: float = Field(default=10.0, ge=0)
    """A version no longer routed keeps being served this long before it is
    unloaded, so requests already routed to it finish (make-before-break)."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """How often the worker writes its status to the workers bucket."""
    ack_wait_s: float = Field(default=0.5, gt=0)
    """JetStream ack wait of a micro-batch's first delivery: one not acked (or kept
    alive) by then goes to another worker. A worker keeps the batches it works on
    alive (``in_progress`` every third of this), so only a dead or frozen worker's
    batches come back: a killed worker's callers are answered about this much later.
    Later deliveries wait `redelivery_backoff_s`."""
    redelivery_backoff_s: list[float] = Field(default=[2.0, 5.0, 10.0])
    """Ack waits of the second, third, ... delivery of a micro-batch (with `ack_wait_s`
    first, JetStream's consumer ``backoff``; cut to ``max_deliver - 1`` entries): a
    batch a frozen worker still holds is not sent around every half second."""
    max_deliver: int = Field(default=5, ge=1)
    """Deliveries of one micro-batch before it is given up."""
    fetch_timeout_s: float = Field(default=1.0, gt=0)
    """Long-poll time of one fetch; also the longest a drain waits for a pending fetch."""
    idle_signal_after_us: float = Field(default=200.0, ge=0)
    """A pull that finds no batch for this long tells the batchers this worker is
    idle (they then send waiting requests at once instead of filling a batch). A
    worker whose next batch is already queued sends no signal."""
    fast_lane: bool = True
    """Take lone requests straight from gateways over core NATS while an execution slot
    is free (the fast lane, ``inferbus_worker.fastlane``); a busy worker refuses them
    and they go through the batcher and the work queue."""
    max_merge_batches: int = Field(default=32, ge=1)
    """Most waiting micro-batches joined into one engine execution (1 disables merging)."""
    inline_run_max_us: float = Field(default=300.0, ge=0)
    """Micro-batches the engine recently ran faster than this (a moving average of
    its run time for batches of about the same row count) run on the event loop
    instead of being handed to an engine thread and back, which costs more than a
    tiny model's run. 0 = always in the engine threads. GPU engines (CUDA or
    TensorRT providers) always use the threads."""
    nak_delay_s: float = Field(default=0.5, ge=0)
    """Redelivery delay of a batch whose engine run failed for a transient reason."""
    max_ack_pending: int = Field(default=1024, ge=1)
    """Un-acked micro-batches a pool's consumer allows in flight (all its workers together)."""
    load_retry_s: float = Field(default=5.0, gt=0)
    """Wait before retrying a version whose load failed (registry down, bad file)."""
    registry_timeout_s: float = Field(default=300.0, gt=0)
    """Limit for downloading one artifact file from the registry."""
    trt_cache_dir: Path | None = None
    """Engine cache of the TensorRT execution provider; ``<cache_dir>/tensorrt`` when unset."""

    script_pool_size: int = Field(default=0, ge=0, le=64)
    """Sandboxed processes running a version's ``preprocessor.py``, per version
    loaded; each serves one batch at a time. 0: as many as the version's execution
    slots (``instance_count``), the most batches its runner works on at once."""
    script_memory_mb: int = Field(default=2048, ge=0)
    """Address-space limit (``RLIMIT_AS``) of each such process (0 = none)."""
    script_cpu_s: float = Field(default=30.0, ge=0)
    """CPU seconds one ``preprocess`` / ``postprocess`` call may use before the
    kernel ends its process (``RLIMIT_CPU``, SIGXCPU; 0 = no limit)."""
    script_timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock limit of a batch's Python processing when none of its requests
    has a deadline (otherwise: the earliest request deadline)."""
    script_reply_margin_ms: float = Field(default=100.0, ge=0)
    """A batch's Python processing is cut this long before its earliest request
    deadline, so its INTERNAL answer reaches the caller before the gateway's own
    timer answers DEADLINE_EXCEEDED."""
    script_start_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a ``preprocessor.py`` process may take to start (import included)."""

    def script_limits(self, slots: int) -> ScriptLimits:
        """The ``script_*`` settings for `inferbus_worker.scriptpool` (for a version
        of `slots` execution slots)."""
        return ScriptLimits(
            pool_size=self.script_pool_size or max(1, slots),
            memory_bytes=self.script_memory_mb << 20,
            cpu_s=self.script_cpu_s,
            timeout_s=self.script_timeout_s,
            start_timeout_s=self.script_start_timeout_s,
        )

    @field_validator("redelivery_backoff_s")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        if any(v <= 0 for v in value):
            raise ValueError("every redelivery ack wait must be positive")
        return value

    def consumer_backoff(self) -> list[float]:
        """The batch consumers' JetStream ``backoff``: the ack wait of each delivery
        ([] when a batch has a single delivery: then `ack_wait_s` alone)."""
        if self.max_deliver <= 1:
            return []
        return [self.ack_wait_s, *self.redelivery_backoff_s][: self.max_deliver - 1]
