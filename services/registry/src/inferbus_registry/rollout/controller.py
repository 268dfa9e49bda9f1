"""The rollout controller: one per registry process, it moves each model's rollout
through its states (records in KV, compare-and-set), judges steps on the audit
evidence and makes the route agree. See docs/architecture.md ("Rollout state
machine").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pydantic import ValidationError

from inferbus_common.catalog import Route, WorkerStatus, ensure_kv
from inferbus_common.catalogrecords import summarize_states
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_common.kvwatch import InitialValues
from inferbus_common.subjects import Subjects
from inferbus_common.versionhealth import WindowStats
from inferbus_registry import metrics
from inferbus_registry.pools import HEARTBEAT_MAX_AGE_S, PoolBook, read_bucket
from inferbus_registry.publisher import CatalogPublisher
from inferbus_registry.repository import ModelRepository
from inferbus_registry.rollout.evidence import AuditEvidence
from inferbus_registry.rollout.records import (
    Rollout,
    StepRecord,
    StepStats,
    check_plan,
    close_step,
    evaluate,
    transition,
)
from inferbus_registry.traffic import (
    ensure_route_history,
    merge_catalog,
    now_ms,
    read_route,
    refuse_unservable,
)

log = logging.getLogger(__name__)


class RolloutController:
    """Runs every model's rollout inside the registry.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        repo: the model repository (versions, the ``stable`` alias).
        publisher: writes routes (compare-and-set) and events.
        pools: the pools bucket (frozen pools refuse rollouts).
        tick_s: how often active rollouts are evaluated.
        instance: this registry's id (recorded in every rollout event: with
            several replicas, which one made the transition).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        repo: ModelRepository,
        publisher: CatalogPublisher,
        pools: PoolBook,
        *,
        tick_s: float = 0.25,
        instance: str = "",
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._repo = repo
        self._publisher = publisher
        self._pools = pools
        self._tick_s = tick_s
        self._instance = instance
        self._kv: KeyValue | None = None
        self._records: dict[str, tuple[Rollout, int]] = {}
        self._evidence = AuditEvidence(nc, subjects)
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._loaded = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Open the bucket, follow it, subscribe to the audit trail, start ticking."""
        self._kv = await ensure_kv(self._nc.jetstream(), self._subjects.rollouts_bucket, history=20)
        await self._publisher.routes_kv()  # the bucket exists before its history is widened
        await ensure_route_history(self._nc.jetstream(), self._subjects)
        # Records only (one token per model): payload captures are not evidence.
        self._sub = await self._nc.subscribe(
            self._subjects.audit_records_all, cb=self._evidence.on_audit
        )
        live_since = now_ms()
        watcher, initial = await InitialValues.watch(self._kv)
        self._tasks.append(
            asyncio.create_task(self._follow(watcher, initial), name="rollouts-follow")
        )
        async with asyncio.timeout(10.0):
            await self._loaded.wait()
        resumed = [r for r, _ in self._records.values() if r.state == "running" and r.ready_unix_ms]
        if resumed:
            self._tasks.append(
                asyncio.create_task(self._replay(resumed, live_since), name="rollouts-replay")
            )
        self._tasks.append(asyncio.create_task(self._run(), name="rollouts-run"))

    async def stop(self) -> None:
        """Stop ticking and following; bounded, idempotent."""
        self._stop.set()
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=5.0)
            if pending:
                log.warning("%d rollout tasks did not stop in time", len(pending))
        self._tasks.clear()
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._sub.unsubscribe()
            self._sub = None

    async def _follow(self, watcher: KeyValue.KeyWatcher, initial: InitialValues) -> None:
        try:
            async for entry in watcher:
                if initial.see(entry):
                    self._loaded.set()
                if entry is None:
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    continue
                try:
                    record = Rollout.model_validate_json(entry.value)
                except ValidationError as exc:
                    log.warning("ignoring malformed rollout record %s: %s", entry.key, exc)
                    continue
                known = self._records.get(record.model)
                if known is None or known[1] < int(entry.revision or 0):
                    self._remember(record, int(entry.revision or 0))
        finally:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(2.0):
                    await watcher.stop()

    async def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            for model in list(self._records):
                try:
                    await self._tick(model)
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                    log.warning("rollout tick failed (NATS): %s", exc, extra={"model": model})
                except Exception:
                    log.exception("rollout tick failed", extra={"model": model})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._tick_s):
                    await self._wake.wait()

    # --- evidence ------------------------------------------------------------------
    @property
    def audit_records_seen(self) -> int:
        """Audit records received (tests probe a fresh subscription with it)."""
        return self._evidence.records_seen

    def stats(self, model: str, version: str, since_unix_ms: int) -> WindowStats:
        """What `version` of `model` did since `since_unix_ms` (from the audit records)."""
        return self._evidence.stats(model, version, since_unix_ms)

    async def _replay(self, rollouts: list[Rollout], until_unix_ms: int) -> None:
        await self._evidence.replay(rollouts, until_unix_ms, self._stop)
        self._wake.set()

    # --- records ---------------------------------------------------------------
    def _bucket(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("RolloutController.start() was not awaited")
        return self._kv

    async def read(self, model: str) -> tuple[Rollout | None, int]:
        """The model's latest rollout and its KV sequence ((None, 0) when it never had one)."""
        try:
            entry = await self._bucket().get(self._subjects.model_key(model))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, 0
        if not entry.value:
            return None, 0
        return Rollout.model_validate_json(entry.value), int(entry.revision or 0)

    async def _write(self, record: Rollout, seq: int) -> int | None:
        """CAS-write a record; None when someone else wrote first (re-read and retry)."""
        record = record.model_copy(update={"updated_unix_ms": now_ms()})
        data = record.model_dump_json().encode()
        key = self._subjects.model_key(record.model)
        try:
            if seq:
                new_seq = await self._bucket().update(key, data, last=seq)
            else:
                new_seq = await self._bucket().create(key, data)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        self._remember(record, int(new_seq))
        return int(new_seq)

    def _remember(self, record: Rollout, seq: int) -> None:
        self._records[record.model] = (record, seq)
        self._evidence.track(record)
        self._wake.set()

    async def _event(self, record: Rollout, event: str, **fields: object) -> None:
        metrics.ROLLOUT_EVENTS.labels(event).inc()
        await self._publisher.event(
            record.model,
            event,
            rollout_id=record.id,
            version=record.version,
            state=record.state,
            step=record.step + 1,
            weight=record.weight,
            reason=record.reason,
            registry=self._instance,
            **fields,
        )

    # --- operator calls --------------------------------------------------------
    async def start_rollout(
        self,
        model: str,
        version: str,
        *,
        steps: list[float],
        interval_s: float,
        max_error_rate: float = 0.01,
        max_p99_ratio: float = 1.5,
        min_requests: int = 20,
        on_fail: str = "rollback",
        requested_by: str = "",
        ready_timeout_s: float = 120.0,
    ) -> Rollout:
        """Start rolling `version` out (see module docstring).

        Raises:
            InvalidArgument: a bad plan, or `version` is the stable one.
            NotFound: unknown model or version.
            FailedPrecondition: a rollout is active, the route has another
                canary, the model has no route, or the version's pool is frozen.
        """
        check_plan(steps, interval_s, max_error_rate, max_p99_ratio, min_requests, on_fail)
        state = await self._repo.state(model)
        version = await self._repo.resolve(model, version)
        refuse_unservable(
            model,
            unloaded=state.unloaded,
            archived=list(state.archived),
            versions=(version,),
            action="a rollout",
        )
        if version not in state.versions:
            raise NotFound(
                f"{model!r} has no routable version {version!r}; versions: {state.versions}"
            )
        current, seq = await self.read(model)
        if current is not None and current.active:
            raise FailedPrecondition(
                f"rollout {current.id} of {model!r} ({current.version}) is {current.state}; "
                f"abort it with `inferbus rollout abort {model}` before starting another"
            )
        route, _ = await read_route(await self._publisher.routes_kv(), self._subjects, model)
        if route is None:
            raise FailedPrecondition(
                f"{model!r} has no route (no stable version, or unloaded); it cannot take a canary"
            )
        if version == route.stable:
            raise InvalidArgument(f"{version!r} already is the stable version of {model!r}")
        if route.canary and route.canary != version:
            raise FailedPrecondition(
                f"{model!r} already has canary {route.canary!r} at {route.canary_weight:g}%; "
                f"clear it with `inferbus route set {model} --canary none` first"
            )
        record = await self._repo.verify(model, version)
        await self._pools.check_open(record.config.pool, f"a rollout of {model} {version}")
        now = now_ms()
        rollout = Rollout(
            id=f"r-{time.strftime('%Y%m%d%H%M%S', time.gmtime())}-{secrets.token_hex(3)}",
            model=model,
            version=version,
            previous_stable=route.stable,
            steps=[float(w) for w in steps],
            interval_s=interval_s,
            max_error_rate=max_error_rate,
            max_p99_ratio=max_p99_ratio,
            min_requests=min_requests,
            on_fail=on_fail,  # type: ignore[arg-type]  # check_plan allowed only rollback/pause
            started_by=requested_by,
            ready_timeout_s=ready_timeout_s if ready_timeout_s > 0 else 120.0,
            reason=f"warming up: waiting for a worker to load {version}",
            created_unix_ms=now,
            step_started_unix_ms=now,
            history=[StepRecord(step=1, weight=float(steps[0]), started_unix_ms=now)],
        )
        if await self._write(rollout, seq) is None:
            raise FailedPrecondition(
                f"another rollout of {model!r} was started at the same time; "
                f"see `inferbus rollout status {model}`"
            )
        await self._event(rollout, "rollout_started", steps=rollout.steps, by=requested_by)
        await self._reconcile(rollout)
        log.info(
            "rollout %s started",
            rollout.id,
            extra={"model": model, "version": version, "updated_by": requested_by},
        )
        return rollout

    async def control(
        self, model: str, action: str, *, requested_by: str = "", reason: str = ""
    ) -> Rollout:
        """pause | resume | abort | rollback the model's rollout.

        Raises:
            NotFound: the model never had a rollout.
            InvalidArgument: unknown action.
            FailedPrecondition: the action does not apply to the current state.
        """
        if action not in ("pause", "resume", "abort", "rollback"):
            raise InvalidArgument(f"unknown action {action!r}: pause, resume, abort or rollback")
        for _ in range(10):
            current, seq = await self.read(model)
            if current is None:
                raise NotFound(f"{model!r} has no rollout; start one with `inferbus rollout start`")
            if action == "rollback" and current.state == "succeeded":
                # Stable moves back: the version it moves to must still be intact.
                await self._repo.verify(model, current.previous_stable)
            if action == "resume":
                state = await self._repo.state(model)
                refuse_unservable(
                    model,
                    unloaded=state.unloaded,
                    archived=list(state.archived),
                    versions=(current.version,),
                    action="a rollout",
                )
            who = f" by {requested_by}" if requested_by else ""
            text = reason or f"{action}{who}"
            new = transition(current, action, text, now_ms())
            if await self._write(new, seq) is None:
                continue
            await self._event(new, f"rollout_{new.state}", action=action, by=requested_by)
            await self._reconcile(new)
            log.info(
                "rollout %s: %s", new.id, action, extra={"model": model, "updated_by": requested_by}
            )
            return new
        raise FailedPrecondition(f"the rollout of {model!r} kept changing; retry")

    # --- the controller --------------------------------------------------------
    async def _tick(self, model: str) -> None:
        record, seq = self._records[model]
        if record.state == "paused":
            await self._reconcile(record)
            return
        if not record.active:
            self._evidence.forget(model, record.version, record.previous_stable)
            if not record.applied:
                await self._reconcile(record)
                await self._write(record.model_copy(update={"applied": True}), seq)
            return
        withdrawn = await self._withdrawn(record)
        if withdrawn:
            await self._end_withdrawn(record, seq, withdrawn)
            return
        await self._reconcile(record)
        if not record.ready_unix_ms:
            await self._warm_up(record, seq)
            return
        since = record.step_started_unix_ms
        canary = self.stats(model, record.version, since)
        stable = self.stats(model, record.previous_stable, since)
        now = now_ms()
        decision = evaluate(record, canary, stable, now)
        if decision.action == "wait":
            return
        windows = {
            "canary": StepStats.of(canary).model_dump(),
            "stable": StepStats.of(stable).model_dump(),
        }
        if decision.action == "fail":
            target = "paused" if record.on_fail == "pause" else "rolled_back"
            new = close_step(
                record, "failed", decision.reason, now, state=target, canary=canary, stable=stable
            )
            if await self._write(new, seq) is None:
                return
            log.warning("rollout %s failed: %s", record.id, decision.reason, extra={"model": model})
            await self._event(new, f"rollout_{target}", **windows)
            await self._reconcile(new)
            return
        # advance
        baseline = stable.p99_ms if stable.requests >= record.min_requests else record.stable_p99_ms
        passed = close_step(
            record, "passed", decision.reason, now, state="running", canary=canary, stable=stable
        )
        if record.step + 1 >= len(record.steps):
            new = passed.model_copy(
                update={
                    "state": "succeeded",
                    "reason": f"{record.version} is stable after {len(record.steps)} steps",
                    "stable_p99_ms": baseline,
                }
            )
            event = "rollout_succeeded"
        else:
            new = passed.model_copy(
                update={
                    "step": record.step + 1,
                    "step_started_unix_ms": now,
                    "stable_p99_ms": baseline,
                    "history": [
                        *passed.history,
                        StepRecord(
                            step=record.step + 2,
                            weight=record.steps[record.step + 1],
                            started_unix_ms=now,
                        ),
                    ],
                }
            )
            event = "rollout_step"
        if await self._write(new, seq) is None:
            return
        await self._event(new, event, **windows)
        await self._reconcile(new)
        self._evidence.prune(model, (record.version, record.previous_stable), now)

    async def _withdrawn(self, record: Rollout) -> str:
        """Why an active rollout's canary can no longer take traffic ('' when it can).

        The route is the cheap signal (one KV read a tick): a model without a
        route, or a canary that left the route's versions, was unloaded,
        archived or deleted; the repository then names which.
        """
        route, _ = await read_route(await self._publisher.routes_kv(), self._subjects, record.model)
        if route is not None and record.version in route.versions:
            return ""
        try:
            state = await self._repo.state(record.model)
        except NotFound:
            return f"{record.model!r} was deleted"
        try:
            refuse_unservable(
                record.model,
                unloaded=state.unloaded,
                archived=list(state.archived),
                versions=(record.version,),
                action="a rollout",
            )
        except FailedPrecondition as exc:
            return exc.message
        if record.version not in state.versions:
            return f"version {record.version!r} of {record.model!r} was deleted"
        return ""  # no route for another reason (e.g. no stable yet): keep waiting

    async def _end_withdrawn(self, record: Rollout, seq: int, reason: str) -> None:
        """Abort a rollout whose canary was taken out of serving under it."""
        new = close_step(record, "aborted", reason, now_ms(), state="aborted")
        if await self._write(new, seq) is None:
            return
        log.warning("rollout %s aborted: %s", record.id, reason, extra={"model": record.model})
        await self._event(new, "rollout_aborted", action="withdrawn", by="registry")
        await self._reconcile(new)

    async def canary_state(self, model: str, version: str) -> str:
        """``ready`` when a live, admitted worker serves it, else the most telling state."""
        raw = await read_bucket(
            await ensure_kv(self._nc.jetstream(), self._subjects.workers_bucket)
        )
        key = f"{model}/{version}"
        states = []
        for value in raw.values():
            try:
                w = WorkerStatus.model_validate_json(value)
            except ValidationError:
                continue
            if key in w.models and w.is_fresh(HEARTBEAT_MAX_AGE_S) and w.admitted:
                states.append(w.models[key])
        return (states and summarize_states(states)) or "no worker has loaded it yet"

    async def _warm_up(self, record: Rollout, seq: int) -> None:
        """Start step 1 once a worker serves the canary; fail when it never does."""
        state = await self.canary_state(record.model, record.version)
        now = now_ms()
        if state == "ready":
            history = list(record.history)
            if history:
                history[-1] = history[-1].model_copy(update={"started_unix_ms": now})
            new = record.model_copy(
                update={
                    "ready_unix_ms": now,
                    "step_started_unix_ms": now,
                    "reason": f"{record.version} is ready; step 1 at {record.weight:g}%",
                    "history": history,
                }
            )
            if await self._write(new, seq) is not None:
                await self._event(new, "rollout_canary_ready")
                await self._reconcile(new)
            return
        if (now - record.created_unix_ms) / 1000.0 < record.ready_timeout_s:
            if record.reason != f"warming up: {state}":
                await self._write(record.model_copy(update={"reason": f"warming up: {state}"}), seq)
            return
        reason = f"{record.version} was not ready after {record.ready_timeout_s:g}s ({state})"
        target = "paused" if record.on_fail == "pause" else "rolled_back"
        new = close_step(record, "failed", reason, now, state=target)
        if await self._write(new, seq) is not None:
            log.warning("rollout %s failed: %s", record.id, reason, extra={"model": record.model})
            await self._event(new, f"rollout_{target}")
            await self._reconcile(new)

    async def _reconcile(self, record: Rollout) -> None:
        """Make the route (and the stable alias) agree with `record`; a no-op when they do."""
        model = record.model
        by = f"rollout {record.id}" + (f" ({record.started_by})" if record.started_by else "")
        if record.active:
            weight = record.weight if record.ready_unix_ms else 0.0

            def mutate(current: Route | None) -> Route | None:
                if current is None or current.stable == record.version:
                    return None
                if current.canary == record.version and current.canary_weight == weight:
                    return None
                return current.model_copy(
                    update={"canary": record.version, "canary_weight": weight}
                )

            change = (
                f"rollout {record.id} step {record.step + 1}: weight {weight:g}"
                if record.ready_unix_ms
                else f"rollout {record.id}: warming up {record.version} (weight 0)"
            )
            await self._publisher.write_route(model, mutate, updated_by=by, change=change)
            return
        if record.state == "succeeded" or (
            record.state == "rolled_back" and record.restored_stable
        ):
            target = record.version if record.state == "succeeded" else record.restored_stable
            state = await self._repo.state(model)
            if state.aliases.get("stable") != target:
                state = await self._repo.set_alias(model, "stable", target)
            base = await self._repo.route(state)
            if base is None:
                return
            change = (
                f"rollout {record.id}: {record.version} promoted to stable"
                if record.state == "succeeded"
                else f"rollout {record.id}: stable restored to {target}"
            )

            def promote(current: Route | None) -> Route | None:
                merged = merge_catalog(base, current)
                if merged.canary == record.version:
                    merged = merged.model_copy(update={"canary": "", "canary_weight": 0.0})
                return merged

            await self._publisher.write_route(model, promote, updated_by=by, change=change)
            return
        # rolled back or aborted while active: the canary leaves the route.

        def clear(current: Route | None) -> Route | None:
            if current is None or current.canary != record.version:
                return None
            return current.model_copy(update={"canary": "", "canary_weight": 0.0})

        await self._publisher.write_route(
            model,
            clear,
            updated_by=by,
            change=f"rollout {record.id} {record.state.replace('_', ' ')}: canary cleared "
            f"({record.reason})",
        )

    def active_rollout(self, model: str) -> Rollout | None:
        """The model's rollout when it is running or paused (from the followed bucket)."""
        current = self._records.get(model)
        return current[0] if current is not None and current[0].active else None
