"""Router settings (env prefix ``INFERBUS_ROUTER_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from inferbus_common.settings import ServiceSettings
from inferbus_router.health import HealthPolicy


class RouterSettings(ServiceSettings):
    """Settings of the router process."""

    model_config = SettingsConfigDict(env_prefix="INFERBUS_ROUTER_", extra="forbid")

    metrics_port: int = Field(default=8012, ge=0, le=65535)
    """/metrics, /healthz, /readyz."""
    queue_group: str = "router"
    """NATS queue group shared by all router instances."""

    shadow_timeout_s: float = Field(default=10.0, gt=0)
    """How long a shadowed request waits for both replies before it is counted
    as timed out and forgotten."""
    shadow_max_pending: int = Field(default=10_000, ge=1)
    """Shadowed requests in flight at most; beyond it samples are dropped (counted)."""

    prefix_placement: bool = True
    """Send a generative request to the worker of its version that holds the longest
    known prefix of its prompt (vLLM prefix caching), while that worker has a free
    running slot; else to the version's queue group. See inferbus_router.prefix."""
    prefix_block_chars: int = Field(default=256, ge=16, le=65536)
    """Characters of prompt text per remembered block."""
    prefix_max_blocks: int = Field(default=100_000, ge=1)
    """Prompt blocks remembered (over all versions, least recently used forgotten)."""

    health_enabled: bool = True
    """Scale canary weights down while a canary is far less healthy than stable."""
    health_interval_s: float = Field(default=2.0, gt=0)
    """How often canary health is re-evaluated (one factor step per evaluation)."""
    health_window_s: float = Field(default=30.0, gt=0)
    """Sliding window of audit records per version."""
    health_min_samples: int = Field(default=30, ge=1)
    """Records needed on the canary before judging (and on stable before its error rate
    and p99 are the baseline)."""
    health_max_error_rate_gap: float = Field(default=0.05, ge=0, le=1)
    """Unhealthy when the canary's error rate exceeds stable's by more than this."""
    health_max_p99_ratio: float = Field(default=2.0, ge=1)
    """Unhealthy when the canary's p99 exceeds stable's times this (plus the slack)."""
    health_p99_slack_ms: float = Field(default=5.0, ge=0)
    """Absolute latency slack added to the p99 threshold."""
    health_floor: float = Field(default=0.1, ge=0, le=1)
    """Lowest factor applied to a canary's configured weight."""
    health_decrease: float = Field(default=0.5, gt=0, lt=1)
    """Factor multiplier per unhealthy evaluation."""
    health_recover_step: float = Field(default=0.1, gt=0, le=1)
    """Factor added back per healthy evaluation (up to 1)."""
    health_warmup_samples: int = Field(default=10, ge=0)
    """First records of each version a router sees whose latency is not counted (a
    freshly loaded version's first requests are not its steady speed; their errors
    still count)."""
    health_alpha: float = Field(default=0.01, gt=0, lt=0.5)
    """Level of the confidence test before a canary is called worse (lower: more
    evidence needed)."""

    def health_policy(self) -> HealthPolicy:
        """The health thresholds as the router uses them."""
        return HealthPolicy(
            window_s=self.health_window_s,
            min_samples=self.health_min_samples,
            max_error_rate_gap=self.health_max_error_rate_gap,
            max_p99_ratio=self.health_max_p99_ratio,
            p99_slack_ms=self.health_p99_slack_ms,
            floor=self.health_floor,
            decrease=self.health_decrease,
            recover_step=self.health_recover_step,
            warmup_samples=self.health_warmup_samples,
            alpha=self.health_alpha,
        )
