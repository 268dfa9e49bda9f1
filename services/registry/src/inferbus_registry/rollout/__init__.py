"""Progressive rollouts: a canary's weight moves step by step, judged by the audit
trail (`records`: the KV records and the step verdict; `evidence`: the audit
windows; `controller`: the state machine). See docs/architecture.md ("Rollout
state machine").
"""

from inferbus_registry.rollout.controller import RolloutController
from inferbus_registry.rollout.records import (
    ACTIVE,
    Decision,
    Rollout,
    StepRecord,
    StepStats,
    check_plan,
    evaluate,
)

__all__ = [
    "ACTIVE",
    "Decision",
    "Rollout",
    "RolloutController",
    "StepRecord",
    "StepStats",
    "check_plan",
    "evaluate",
]
