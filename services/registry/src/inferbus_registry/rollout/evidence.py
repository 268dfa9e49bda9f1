"""A rollout's evidence: the gateways' audit records of the canary and its stable
version, kept per version while the rollout is active, and read back from the
audit stream after a registry restart. See docs/architecture.md ("Rollout
state machine").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from inferbus_common.audit import split_records
from inferbus_common.subjects import Subjects
from inferbus_common.versionhealth import OutcomeWindow, WindowStats
from inferbus_registry.rollout.records import Rollout

log = logging.getLogger(__name__)

REPLAY_MAX_RECORDS = 200_000
"""Most audit records read back from the stream per rollout after a restart."""
WARMUP_RECORDS = 10
"""First records of each version's window whose latency is not counted (a freshly
loaded canary's first requests are not its steady speed)."""


class AuditEvidence:
    """Outcome windows of the versions of active rollouts, fed by audit records.

    Args:
        nc: connected NATS client (for the replay).
        subjects: naming scheme.
    """

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects
        self._windows: dict[tuple[str, str], OutcomeWindow] = {}
        self._active: dict[str, tuple[str, str]] = {}
        """model → (canary, previous stable) of its active rollout."""
        self._active_tokens: set[str] = set()
        """Subject tokens of the models with an active rollout (cheap filter)."""
        self.records_seen = 0
        """Audit records received (tests probe a fresh subscription with it)."""

    def track(self, rollout: Rollout) -> None:
        """Keep (or stop keeping) evidence for `rollout`'s versions as its state says."""
        token = self._subjects.model_key(rollout.model)
        if rollout.active:
            self._active[rollout.model] = (rollout.version, rollout.previous_stable)
            self._active_tokens.add(token)
        else:
            self._active.pop(rollout.model, None)
            self._active_tokens.discard(token)

    def forget(self, model: str, *versions: str) -> None:
        """Drop the windows of `versions` of `model`."""
        for version in versions:
            self._windows.pop((model, version), None)

    def prune(self, model: str, versions: tuple[str, ...], before_unix_ms: int) -> None:
        """Forget what `versions` did before `before_unix_ms` (a new step's window)."""
        for version in versions:
            window = self._windows.get((model, version))
            if window is not None:
                window.prune(before_unix_ms)

    def stats(self, model: str, version: str, since_unix_ms: int) -> WindowStats:
        """What `version` of `model` did since `since_unix_ms`."""
        window = self._windows.get((model, version))
        return window.stats(since_unix_ms) if window else WindowStats()

    async def on_audit(self, msg: Msg) -> None:
        """Subscription callback on the audit records (one record per line)."""
        self.records_seen += 1 + msg.data.count(b"\n")
        # Cheap filter first: most records are of models without an active rollout.
        if msg.subject.rsplit(".", 1)[-1] not in self._active_tokens:
            return
        self.add(msg.data)

    def add(self, data: bytes, *, before_unix_ms: int = 0) -> int:
        """Keep the outcomes of one audit message's records that are evidence for an
        active rollout; how many were kept. `before_unix_ms` (replay): only records
        stamped earlier, the live subscription has the rest."""
        kept = 0
        for line in split_records(data):
            kept += self._add_one(line, before_unix_ms)
        return kept

    def _add_one(self, data: bytes, before_unix_ms: int) -> int:
        try:
            rec = json.loads(data)
            model, version = str(rec["model"]), str(rec.get("version") or "")
            status = str(rec["status"])
            ts = int(rec["ts_unix_ms"])
            latency = float(rec.get("latency_ms") or 0.0)
        except (ValueError, KeyError, TypeError):
            return 0
        if before_unix_ms and ts >= before_unix_ms:
            return 0
        if version not in self._active.get(model, ()):
            return 0
        window = self._windows.get((model, version))
        if window is None:
            window = self._windows[(model, version)] = OutcomeWindow(warmup=WARMUP_RECORDS)
        return int(window.add(ts, status, latency))

    async def replay(
        self, rollouts: list[Rollout], until_unix_ms: int, stop: asyncio.Event
    ) -> None:
        """Refill the current steps' windows from the audit stream after a restart.

        The live subscription covers what is published from `until_unix_ms`
        on; the records of the step's window before that are read back from
        ``<PREFIX>_AUDIT`` (when it exists: the gateway creates it), so a
        restarted registry judges the step on all its evidence instead of
        starting the window again. Bounded in records and time; best effort.
        """
        js = self._nc.jetstream()
        for rollout in rollouts:
            start_s = rollout.step_started_unix_ms / 1000.0
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME,
                # nats-py sends a datetime as RFC 3339 UTC text.
                opt_start_time=datetime.fromtimestamp(start_s, UTC),
                ack_policy=AckPolicy.NONE,
                inactive_threshold=30.0,
                mem_storage=True,
            )
            replayed = 0
            try:
                sub = await js.pull_subscribe(
                    self._subjects.audit(rollout.model),
                    stream=self._subjects.audit_stream,
                    config=config,
                )
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                log.info("no audit replay for %s: %s", rollout.model, exc)
                continue
            try:
                async with asyncio.timeout(10.0):
                    while replayed < REPLAY_MAX_RECORDS and not stop.is_set():
                        try:
                            msgs = await sub.fetch(512, timeout=1.0)
                        except (TimeoutError, nats.errors.TimeoutError):
                            break
                        pending = 0
                        for msg in msgs:
                            pending = msg.metadata.num_pending
                            replayed += self.add(msg.data, before_unix_ms=until_unix_ms)
                        if pending == 0:
                            break
            except TimeoutError:
                log.warning("audit replay for %s stopped after 10 s", rollout.model)
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("audit replay for %s failed: %s", rollout.model, exc)
            finally:
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    async with asyncio.timeout(2.0):
                        await sub.unsubscribe()
            log.info(
                "rollout %s resumed with %d audit records replayed",
                rollout.id,
                replayed,
                extra={"model": rollout.model},
            )
