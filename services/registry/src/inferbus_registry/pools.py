"""Worker pools: quotas and release state in KV, and the ledger ``inferbus pools`` prints.

A pool is a name: workers join one (``INFERBUS_WORKER_POOL``) and a version is
placed on one (its ``config.pool``). The pools bucket adds what a name cannot
say: how many workers and GPUs the pool may use (workers over quota stay
not-ready, see `inferbus_common.poolquota.pool_admission`) and its release state
(``frozen``: no traffic changes or rollouts onto its versions).

The ledger is computed on demand from the four catalog buckets and the
micro-batch stream's consumers; nothing here runs in the background.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue
from pydantic import ValidationError

from inferbus_common.catalog import DeployedVersion, Route, WorkerStatus, ensure_kv
from inferbus_common.catalogrecords import POOL_STATES, PoolSpec
from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_common.kvwatch import InitialValues
from inferbus_common.poolquota import count_gpus, pool_admission
from inferbus_common.subjects import Subjects, subject_token
from inferbus_registry.traffic import now_ms

log = logging.getLogger(__name__)

#: A heartbeat older than this does not count as a live worker in the ledger.
HEARTBEAT_MAX_AGE_S = 15.0


async def read_bucket(kv: KeyValue) -> dict[str, bytes]:
    """Every live key's value in a bucket (one watcher pass, no per-key round trips)."""
    out: dict[str, bytes] = {}
    watcher, initial = await InitialValues.watch(kv)
    try:
        async for entry in watcher:
            if entry is not None:
                if entry.value and entry.operation not in ("DEL", "PURGE"):
                    out[entry.key] = entry.value
                else:
                    out.pop(entry.key, None)
            if initial.see(entry):
                break
    finally:
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            await watcher.stop()
    return out


@dataclass(slots=True)
class PoolLedger:
    """One pool as the ledger shows it."""

    name: str
    spec: PoolSpec
    configured: bool
    """False when the pool has no entry in the pools bucket (defaults apply)."""
    workers: list[WorkerStatus] = field(default_factory=list)
    admission: dict[str, str] = field(default_factory=dict)
    """Worker id → '' (admitted) or the reason it is kept out."""
    placed: list[str] = field(default_factory=list)
    """``model/version`` routed onto the pool."""
    queue_lag: int = 0

    @property
    def total_gpus(self) -> int:
        """Physical GPUs of the live workers (by UUID: a GPU shared by two workers is one)."""
        return count_gpus(self.workers)


class PoolBook:
    """The pools bucket and the ledger.

    Args:
        nc: a connected NATS client.
        subjects: naming scheme.
    """

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await ensure_kv(self._nc.jetstream(), self._subjects.pools_bucket)
        return self._kv

    async def get(self, name: str) -> PoolSpec | None:
        """A pool's spec, or None when it was never configured."""
        kv = await self._bucket()
        try:
            entry = await kv.get(subject_token(name))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if not entry.value:
            return None
        return PoolSpec.model_validate_json(entry.value)

    async def check_open(self, pool: str, what: str) -> None:
        """Refuse `what` when `pool` is frozen.

        Raises:
            FailedPrecondition: the pool's release state is ``frozen``.
        """
        spec = await self.get(pool)
        if spec is not None and spec.state == "frozen":
            raise FailedPrecondition(
                f"pool '{pool}' is frozen: {what} refused; unfreeze it with "
                f"`inferbus pools set {pool} --state open`"
            )

    async def set(
        self,
        name: str,
        *,
        max_workers: int | None = None,
        max_gpus: int | None = None,
        state: str | None = None,
        updated_by: str = "",
    ) -> PoolSpec:
        """Create or change a pool (unset arguments keep their value).

        Raises:
            InvalidArgument: empty name, negative quota or unknown state.
        """
        if not name.strip():
            raise InvalidArgument("a pool needs a name")
        if max_workers is not None and max_workers < 0:
            raise InvalidArgument("max_workers must be 0 (unlimited) or more")
        if max_gpus is not None and max_gpus < 0:
            raise InvalidArgument("max_gpus must be 0 (unlimited) or more")
        if state is not None and state not in POOL_STATES:
            raise InvalidArgument(f"pool state {state!r} is not one of {list(POOL_STATES)}")
        kv = await self._bucket()
        key = subject_token(name)
        for _ in range(10):
            try:
                entry = await kv.get(key)
                current = PoolSpec.model_validate_json(entry.value or b"")
                seq = int(entry.revision or 0)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                current, seq = PoolSpec(name=name), 0
            except ValidationError:
                current, seq = PoolSpec(name=name), int(entry.revision or 0)
            update: dict[str, object] = {"updated_by": updated_by, "updated_unix_ms": now_ms()}
            if max_workers is not None:
                update["max_workers"] = max_workers
            if max_gpus is not None:
                update["max_gpus"] = max_gpus
            if state is not None:
                update["state"] = state
            new = current.model_copy(update=update)
            data = new.model_dump_json().encode()
            try:
                if seq:
                    await kv.update(key, data, last=seq)
                else:
                    await kv.create(key, data)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # someone else changed it: apply ours on top of theirs
            log.info("pool %s set", name, extra={"pool": name, "updated_by": updated_by})
            return new
        raise FailedPrecondition(f"pool '{name}' kept changing while being set; retry")

    async def ledger(self) -> list[PoolLedger]:
        """Every pool that is configured, has live workers or has versions placed on it."""
        js = self._nc.jetstream()
        specs = {
            s.name: s for s in _parse(await read_bucket(await self._bucket()), PoolSpec).values()
        }
        workers = [
            w
            for w in _parse(
                await read_bucket(await ensure_kv(js, self._subjects.workers_bucket)),
                WorkerStatus,
            ).values()
            if w.is_fresh(HEARTBEAT_MAX_AGE_S)
        ]
        versions = {
            (dv.model, dv.version): dv
            for dv in _parse(
                await read_bucket(await ensure_kv(js, self._subjects.models_bucket)),
                DeployedVersion,
            ).values()
        }
        routes = _parse(
            await read_bucket(await ensure_kv(js, self._subjects.routes_bucket)), Route
        ).values()

        placed: dict[str, set[str]] = {}
        for route in routes:
            routed = {route.stable, *route.aliases.values()}
            routed |= {v for v in (route.canary, route.shadow) if v}
            for version in routed:
                dv = versions.get((route.model, version))
                pool = route.pool if version == route.stable else (dv.config.pool if dv else "")
                if pool:
                    placed.setdefault(pool, set()).add(f"{route.model}/{version}")

        names = set(specs) | {w.pool for w in workers} | set(placed)
        lag = await self._queue_lag(names)
        out = []
        for name in sorted(names):
            spec = specs.get(name)
            members = sorted((w for w in workers if w.pool == name), key=lambda w: w.worker_id)
            out.append(
                PoolLedger(
                    name=name,
                    spec=spec or PoolSpec(name=name),
                    configured=spec is not None,
                    workers=members,
                    admission=pool_admission(name, members, spec),
                    placed=sorted(placed.get(name, set())),
                    queue_lag=lag.get(name, 0),
                )
            )
        return out

    async def _queue_lag(self, pools: Collection[str]) -> dict[str, int]:
        """Pending + unacked micro-batches of each pool's durable consumers."""
        prefixes = {f"w_{subject_token(p)}__": p for p in pools}
        out: dict[str, int] = {}
        try:
            infos = await self._nc.jetstream().consumers_info(self._subjects.batch_stream)
        except (nats.js.errors.NotFoundError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.debug("no consumer info for the ledger: %s", exc)
            return out
        for info in infos:
            name = info.name or (info.config.durable_name if info.config else "") or ""
            for prefix, pool in prefixes.items():
                if name.startswith(prefix):
                    out[pool] = (
                        out.get(pool, 0) + (info.num_pending or 0) + (info.num_ack_pending or 0)
                    )
        return out


M = TypeVar("M", PoolSpec, WorkerStatus, DeployedVersion, Route)


def _parse(raw: dict[str, bytes], model: type[M]) -> dict[str, M]:
    out: dict[str, M] = {}
    for key, value in raw.items():
        try:
            out[key] = model.model_validate_json(value)
        except ValidationError as exc:
            log.warning("ignoring malformed entry %s: %s", key, exc)
    return out
