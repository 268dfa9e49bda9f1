"""The release-management RPCs of the registry: route writes, rollouts, pools.

A mixin of `RegistryService` (kept apart so the model-repository RPCs and
these evolve without touching each other). Errors are answered as
`grpcerrors.answer` says.
"""

from __future__ import annotations

import logging

import grpc

from inferbus_common.catalog import Route
from inferbus_common.errors import (
    FailedPrecondition,
    NotFound,
)
from inferbus_proto.registry import registry_pb2
from inferbus_registry import metrics
from inferbus_registry.grpcerrors import answer
from inferbus_registry.pools import PoolBook, PoolLedger
from inferbus_registry.publisher import CatalogPublisher
from inferbus_registry.repository import ModelRepository
from inferbus_registry.rollout import Rollout, RolloutController
from inferbus_registry.traffic import (
    RouteChanged,
    TrafficChange,
    apply_traffic,
    read_route,
    refuse_unservable,
    route_history,
)

log = logging.getLogger(__name__)


def rollout_state(rollout: Rollout) -> registry_pb2.RolloutState:
    """The protobuf form of a rollout record."""
    return registry_pb2.RolloutState(rollout_json=rollout.model_dump_json().encode())


def pool_info(entry: PoolLedger) -> registry_pb2.PoolInfo:
    """The protobuf form of one ledger line."""
    return registry_pb2.PoolInfo(
        name=entry.name,
        max_workers=entry.spec.max_workers,
        max_gpus=entry.spec.max_gpus,
        state=entry.spec.state,
        workers=[
            registry_pb2.PoolWorker(
                worker_id=w.worker_id,
                host=w.host,
                cpus=w.cpus,
                memory_bytes=w.memory_bytes,
                gpu_type=w.gpu_type,
                gpu_count=w.gpu_count,
                admitted=not entry.admission.get(w.worker_id, ""),
                reason=entry.admission.get(w.worker_id, ""),
                models=dict(w.models),
            )
            for w in entry.workers
        ],
        total_gpus=entry.total_gpus,
        placed=entry.placed,
        queue_lag=entry.queue_lag,
        updated_by=entry.spec.updated_by,
        updated_unix_ms=entry.spec.updated_unix_ms,
        configured=entry.configured,
    )


class ReleaseRPCs:
    """GetRoute, SetTraffic, Start/Get/ControlRollout, ListPools, SetPool.

    The class that mixes it in sets `_repo`, `_publisher`, `_rollouts` and
    `_pools` (the last two None when the registry runs without them).
    """

    _repo: ModelRepository
    _publisher: CatalogPublisher
    _rollouts: RolloutController | None
    _pools: PoolBook | None

    def _need_rollouts(self) -> RolloutController:
        if self._rollouts is None:
            raise FailedPrecondition("this registry runs without the rollout controller")
        return self._rollouts

    def _need_pools(self) -> PoolBook:
        if self._pools is None:
            raise FailedPrecondition("this registry runs without the pools bucket")
        return self._pools

    async def _route_state(self, model: str, history: int) -> registry_pb2.RouteState:
        kv = await self._publisher.routes_kv()
        route, seq = await read_route(kv, self._publisher.subjects, model)
        if route is None:
            await self._repo.state(model)  # NotFound for an unknown model
            raise NotFound(
                f"{model!r} has no route (no stable version yet, or unloaded); set one with "
                f"`inferbus models alias {model} stable VERSION`"
            )
        earlier = await route_history(
            self._publisher.jetstream(), self._publisher.subjects, model, history
        )
        return registry_pb2.RouteState(
            route_json=route.model_dump_json().encode(),
            kv_revision=seq,
            history_json=[r.model_dump_json().encode() for r in earlier],
        )

    async def GetRoute(
        self, request: registry_pb2.GetRouteRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RouteState:
        """The model's route, its KV revision and up to `history` earlier revisions."""
        return await answer(
            context, "GetRoute", lambda: self._route_state(request.model, request.history)
        )

    async def _set_traffic(
        self, request: registry_pb2.SetTrafficRequest
    ) -> registry_pb2.RouteState:
        model = request.model
        state = await self._repo.state(model)
        versions = [v for v in state.versions if v not in set(state.archived)]

        has = request.HasField
        change = TrafficChange(
            canary=_version_arg(request.canary if has("canary") else None),
            canary_weight=request.canary_weight if has("canary_weight") else None,
            shadow=_version_arg(request.shadow if has("shadow") else None),
            shadow_rate=request.shadow_rate if has("shadow_rate") else None,
            sticky=request.sticky if has("sticky") else None,
            pool=request.pool if has("pool") else None,
        )
        touches_canary = change.canary is not None or change.canary_weight is not None
        if touches_canary and self._rollouts is not None:
            active = self._rollouts.active_rollout(model)
            if active is not None:
                raise FailedPrecondition(
                    f"rollout {active.id} of {model!r} is {active.state} and owns the canary; "
                    f"pause, abort or roll it back (`inferbus rollout abort {model}`) first"
                )
        # Aliases name versions too (e.g. --canary latest).
        for kind in ("canary", "shadow"):
            value = getattr(change, kind)
            if value and value not in versions and value in state.aliases:
                change = _replace(change, kind, state.aliases[value])
        refuse_unservable(
            model,
            unloaded=state.unloaded,
            archived=list(state.archived),
            versions=(change.canary or "", change.shadow or ""),
        )
        if not request.force:
            # Refuse a corrupt or foreign artifact before traffic moves to it.
            for version in {change.canary or "", change.shadow or ""} - {""}:
                if version in versions:  # an unknown one is refused by apply_traffic
                    await self._repo.verify(model, version)
        pools = self._pools
        frozen_checks: list[tuple[str, str]] = []
        if pools is not None:
            if change.canary or (change.canary_weight or 0) > 0:
                frozen_checks.append(("canary", change.canary or ""))
            if change.shadow or (change.shadow_rate or 0) > 0:
                frozen_checks.append(("shadow", change.shadow or ""))
            if change.pool:
                await pools.check_open(change.pool, f"moving {model} onto it")

        def mutate(current: Route | None) -> Route | None:
            if current is None:
                raise FailedPrecondition(
                    f"{model!r} has no route (no stable version yet, or unloaded); traffic "
                    "can only be split once it has one"
                )
            return apply_traffic(current, change, versions)

        if pools is not None and frozen_checks:
            current, _ = await read_route(
                await self._publisher.routes_kv(), self._publisher.subjects, model
            )
            for kind, version in frozen_checks:
                version = version or (getattr(current, kind) if current else "")
                if version in versions:  # an unknown one is refused by apply_traffic
                    record = await self._repo.get_version(model, version)
                    await pools.check_open(
                        record.config.pool, f"sending {kind} traffic to {model} {version}"
                    )
        who = request.updated_by or "unknown"
        if who == "registry" or who.startswith("rollout "):
            who = f"{who} (via SetTraffic)"  # the registry's own names stay unambiguous
        try:
            write = await self._publisher.write_route(
                model,
                mutate,
                updated_by=who,
                change=request.change,
                expected_kv_revision=request.expected_kv_revision,
            )
        except RouteChanged:
            metrics.ROUTE_CONFLICTS.inc()
            raise
        assert write.route is not None  # mutate refuses a missing route
        if write.changed:
            log.info(
                "traffic set",
                extra={"model": model, "updated_by": who, "revision": write.route.revision},
            )
        # The route this call wrote (or found unchanged), not a re-read that may
        # already show a later writer's change.
        return registry_pb2.RouteState(
            route_json=write.route.model_dump_json().encode(), kv_revision=write.kv_revision
        )

    async def SetTraffic(
        self, request: registry_pb2.SetTrafficRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RouteState:
        """Change canary/shadow/sticky/pool with compare-and-set (see the .proto)."""
        return await answer(context, "SetTraffic", lambda: self._set_traffic(request))

    async def StartRollout(
        self, request: registry_pb2.StartRolloutRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RolloutState:
        """Start a progressive rollout."""

        async def call() -> registry_pb2.RolloutState:
            rollout = await self._need_rollouts().start_rollout(
                request.model,
                request.version,
                steps=list(request.steps),
                interval_s=request.interval_s,
                max_error_rate=(
                    request.max_error_rate if request.HasField("max_error_rate") else 0.01
                ),
                max_p99_ratio=request.max_p99_ratio if request.HasField("max_p99_ratio") else 1.5,
                min_requests=request.min_requests if request.HasField("min_requests") else 20,
                on_fail=request.on_fail or "rollback",
                requested_by=request.requested_by,
                ready_timeout_s=request.ready_timeout_s,
            )
            return rollout_state(rollout)

        return await answer(context, "StartRollout", call)

    async def GetRollout(
        self, request: registry_pb2.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RolloutState:
        """The model's latest rollout."""

        async def call() -> registry_pb2.RolloutState:
            rollout, _ = await self._need_rollouts().read(request.model)
            if rollout is None:
                raise NotFound(
                    f"{request.model!r} has no rollout; start one with `inferbus rollout start`"
                )
            return rollout_state(rollout)

        return await answer(context, "GetRollout", call)

    async def ControlRollout(
        self, request: registry_pb2.ControlRolloutRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RolloutState:
        """pause | resume | abort | rollback."""

        async def call() -> registry_pb2.RolloutState:
            rollout = await self._need_rollouts().control(
                request.model,
                request.action,
                requested_by=request.requested_by,
                reason=request.reason,
            )
            return rollout_state(rollout)

        return await answer(context, "ControlRollout", call)

    async def ListPools(
        self, request: registry_pb2.ListPoolsRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListPoolsResponse:
        """The pool ledger."""

        async def call() -> registry_pb2.ListPoolsResponse:
            ledger = await self._need_pools().ledger()
            return registry_pb2.ListPoolsResponse(pools=[pool_info(e) for e in ledger])

        return await answer(context, "ListPools", call)

    async def SetPool(
        self, request: registry_pb2.SetPoolRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.PoolInfo:
        """Create or change a pool's quota and release state."""

        async def call() -> registry_pb2.PoolInfo:
            pools = self._need_pools()
            spec = await pools.set(
                request.name,
                max_workers=request.max_workers if request.HasField("max_workers") else None,
                max_gpus=request.max_gpus if request.HasField("max_gpus") else None,
                state=request.state if request.HasField("state") else None,
                updated_by=request.updated_by,
            )
            for entry in await pools.ledger():
                if entry.name == spec.name:
                    return pool_info(entry)
            return pool_info(PoolLedger(name=spec.name, spec=spec, configured=True))

        return await answer(context, "SetPool", call)


def _version_arg(value: object) -> str | None:
    """A canary/shadow argument: None keeps, ''/none/off clears."""
    if value is None:
        return None
    text = str(value).strip()
    return "" if text.lower() in ("", "none", "off") else text


def _replace(change: TrafficChange, kind: str, version: str) -> TrafficChange:
    fields = {f: getattr(change, f) for f in TrafficChange.__dataclass_fields__}
    fields[kind] = version
    return TrafficChange(**fields)
