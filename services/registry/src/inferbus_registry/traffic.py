"""Route writes: every change to a model's `Route` is a compare-and-set on its KV entry.

Two kinds of writer share the routes bucket:

* the catalog (pushes, alias moves, archive/unload): it recomputes the
  *catalog part* of the route (stable, versions, aliases, stable's pool) from
  the object store, and `merge_catalog` keeps the *traffic part* (canary,
  shadow, stickiness, pool override) that only lives in KV;
* traffic changes (`SetTraffic`, the rollout controller): they change the
  traffic part and nothing else.

Both go through `cas_write`: read the entry and its KV sequence, compute the
new route, write it with ``update(last=sequence)``. A concurrent writer makes
the update fail; internal writers re-read and retry, an operator who passed
the revision they read gets FAILED_PRECONDITION "route changed, re-read".
Every real change bumps `Route.revision` by one and records who, when and
why (`updated_by`, `updated_unix_ms`, `change`); a write that changes nothing
is skipped, so republishing the catalog on start-up does not bump revisions.

The traffic part lives only in KV (the object store holds versions and
aliases): a NATS server that loses its JetStream state comes back with
routes that send everything to stable, the safe default.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from pydantic import ValidationError

from inferbus_common.catalog import Route
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

#: Fields of `Route` that only traffic writers change (kept across catalog writes).
TRAFFIC_FIELDS = ("canary", "canary_weight", "shadow", "shadow_rate", "sticky")
#: Bookkeeping fields: not compared when deciding whether a write changes anything.
META_FIELDS = ("revision", "updated_by", "updated_unix_ms", "change")
#: How often an internal writer retries after losing a compare-and-set race.
CAS_ATTEMPTS = 20

_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


class RouteChanged(FailedPrecondition):
    """The route's KV revision is not the one the caller read."""


@dataclass(frozen=True, slots=True)
class RouteWrite:
    """The outcome of `cas_write`."""

    route: Route | None
    """The route now stored (None: the model has no route)."""
    kv_revision: int
    """KV sequence of `route` (0 when none)."""
    previous: Route | None
    changed: bool
    """False when the write was skipped because nothing changed."""


ROUTE_HISTORY = 64
"""Revisions of each route the routes bucket keeps (NATS KV's maximum): the audit
trail of a rollout is one revision per step."""


def _routes_stream(subjects: Subjects) -> str:
    """The JetStream stream behind the routes bucket."""
    return f"KV_{subjects.routes_bucket}"


async def ensure_route_history(js: JetStreamContext, subjects: Subjects) -> None:
    """Raise the routes bucket's history to `ROUTE_HISTORY` revisions per key.

    Whichever service starts first creates the bucket (with a short history);
    the registry, which writes routes, widens it so `inferbus route show` can
    show a whole rollout. Idempotent; never shrinks a longer history.
    """
    info = await js.stream_info(_routes_stream(subjects))
    if (info.config.max_msgs_per_subject or 0) < ROUTE_HISTORY:
        info.config.max_msgs_per_subject = ROUTE_HISTORY
        await js.update_stream(info.config)
        log.info("routes bucket keeps %d revisions per model", ROUTE_HISTORY)


def now_ms() -> int:
    """Wall-clock milliseconds (record timestamps, never timeouts)."""
    return time.time_ns() // 1_000_000


def same_content(a: Route | None, b: Route | None) -> bool:
    """Whether two routes differ only in bookkeeping (revision, who, when, why)."""
    if a is None or b is None:
        return a is b
    return a.model_dump(exclude=set(META_FIELDS)) == b.model_dump(exclude=set(META_FIELDS))


def describe(previous: Route | None, new: Route) -> str:
    """A short text of what changed, e.g. ``stable 1 -> 2; canary 2 -> ''``."""
    if previous is None:
        return f"route created: stable {new.stable}"
    parts = []
    for name in ("stable", "pool", *TRAFFIC_FIELDS):
        old, cur = getattr(previous, name), getattr(new, name)
        if old != cur:
            parts.append(f"{name} {old!r} -> {cur!r}")
    if previous.aliases != new.aliases:
        parts.append(f"aliases {previous.aliases} -> {new.aliases}")
    if previous.versions != new.versions:
        parts.append(f"versions {previous.versions} -> {new.versions}")
    return "; ".join(parts) or "no change"


def clear_stale_traffic(route: Route) -> Route:
    """Drop a canary or shadow that is the stable version or no longer routable.

    This is what keeps one rollout's leftovers out of the next: promoting the
    canary to stable, or archiving/deleting it, removes it from the route.
    """
    update: dict[str, object] = {}
    if route.canary and (route.canary == route.stable or route.canary not in route.versions):
        update |= {"canary": "", "canary_weight": 0.0}
    if not route.canary and route.canary_weight:
        update["canary_weight"] = 0.0
    if route.shadow and (route.shadow == route.stable or route.shadow not in route.versions):
        update |= {"shadow": "", "shadow_rate": 0.0}
    if not route.shadow and route.shadow_rate:
        update["shadow_rate"] = 0.0
    return route.model_copy(update=update) if update else route


def merge_catalog(base: Route, current: Route | None) -> Route:
    """The catalog's new `base` route with the traffic part of the `current` one.

    The pool override of a traffic write is kept while the stable version
    stays the same; a new stable version brings its own `config.pool`.
    """
    if current is None:
        return clear_stale_traffic(base)
    update: dict[str, object] = {f: getattr(current, f) for f in TRAFFIC_FIELDS + META_FIELDS}
    if current.stable == base.stable:
        update["pool"] = current.pool
    return clear_stale_traffic(base.model_copy(update=update))


Ready = Callable[[str, str], bool]
"""(model, version) → a live worker reports it ready."""


def hold_stable(new: Route, current: Route | None, ready: Ready, now_unix_ms: int) -> Route:
    """`new` (a catalog write) with ``stable`` held on the serving version when needed.

    Held when the write moves ``stable`` away from `current`'s, the version
    moved to is not ready anywhere, and the serving one is ready and still
    routable. Otherwise any pending promotion is cleared.
    """
    target = new.stable
    serving = current.stable if current is not None else ""
    hold = (
        current is not None
        and target != serving
        and serving in new.versions
        and not ready(new.model, target)
        and ready(new.model, serving)
    )
    if not hold:
        if new.stable_pending or new.stable_pending_since_unix_ms:
            return new.model_copy(update={"stable_pending": "", "stable_pending_since_unix_ms": 0})
        return new
    assert current is not None
    since = (
        current.stable_pending_since_unix_ms
        if current.stable_pending == target and current.stable_pending_since_unix_ms
        else now_unix_ms
    )
    return new.model_copy(
        update={
            "stable": serving,
            "pool": current.pool,
            "aliases": {**new.aliases, "stable": serving},
            "stable_pending": target,
            "stable_pending_since_unix_ms": since,
        }
    )


async def read_route(kv: KeyValue, subjects: Subjects, model: str) -> tuple[Route | None, int]:
    """The model's route and its KV sequence; (None, 0) when it has none."""
    try:
        entry = await kv.get(subjects.model_key(model))
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None, 0
    if entry.value is None or entry.operation in ("DEL", "PURGE"):
        return None, 0
    return Route.model_validate_json(entry.value), int(entry.revision or 0)


async def route_records(js: JetStreamContext, subjects: Subjects, model: str) -> list[Route]:
    """The routes of `model` the routes bucket still holds, oldest first (deletions
    left out).

    Read a message at a time ("next by subject"), not with nats-py's
    `KeyValue.history`: its watcher decides it has seen every entry by comparing
    the consumer's pending count with what its callback has handled, and now
    and then ends before the first one (3 of 300 reads of a 4-entry history on
    an idle machine). An empty history restarted route revisions at 1 after an
    unload (a CI failure of `test_revisions_keep_growing_across_an_unload_and_reload`).
    """
    subject = f"$KV.{subjects.routes_bucket}.{subjects.model_key(model)}"
    out: list[Route] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(_routes_stream(subjects), seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return out
        if msg.data and (msg.headers or {}).get(KV_OP) not in (KV_DEL, KV_PURGE):
            try:
                out.append(Route.model_validate_json(msg.data))
            except ValidationError:
                pass
        seq = (msg.seq or seq) + 1


async def route_history(
    js: JetStreamContext, subjects: Subjects, model: str, limit: int
) -> list[Route]:
    """Earlier routes of a model, newest first (at most `limit`); the newest
    record, the current route, is not among them."""
    if limit <= 0:
        return []
    return list(reversed(await route_records(js, subjects, model)))[1 : limit + 1]


async def cas_write(
    kv: KeyValue,
    subjects: Subjects,
    model: str,
    mutate: Callable[[Route | None], Route | None],
    *,
    js: JetStreamContext,
    updated_by: str,
    change: str = "",
    expected_kv_revision: int = 0,
    on_change: Callable[[RouteWrite], Awaitable[None]] | None = None,
) -> RouteWrite:
    """Change a model's route with compare-and-set on its KV sequence.

    Args:
        kv: the routes bucket.
        subjects: naming scheme (for the key).
        model: model name.
        mutate: current route (None: none yet) → new route (None: leave it
            as it is). It may raise to refuse the change; it may be called
            again after a lost race, with the newer route.
        js: JetStream, to read the records a removed route left (`route_records`).
        updated_by: who makes the change (recorded in the route).
        change: why (recorded; default: a description of the difference).
        expected_kv_revision: non-zero: the KV sequence the caller read; a
            different current sequence fails with `RouteChanged`.
        on_change: awaited after a real change was written (events).

    Raises:
        RouteChanged: `expected_kv_revision` is stale, or the race was lost
            `CAS_ATTEMPTS` times in a row.
    """
    key = subjects.model_key(model)
    for _ in range(CAS_ATTEMPTS):
        current, seq = await read_route(kv, subjects, model)
        if expected_kv_revision and seq != expected_kv_revision:
            raise RouteChanged(
                f"route of {model!r} changed (KV revision {seq}, you read "
                f"{expected_kv_revision}), re-read it with `inferbus route show {model}` "
                "and apply your change again"
            )
        new = mutate(current)
        if new is None or same_content(current, new):
            return RouteWrite(current, seq, current, changed=False)
        if current is None:
            # Revisions survive a removal: continue from the newest record kept.
            kept = await route_records(js, subjects, model)
            base_revision = max((r.revision for r in kept), default=0)
        else:
            base_revision = current.revision
        new = new.model_copy(
            update={
                "revision": base_revision + 1,
                "updated_by": updated_by,
                "updated_unix_ms": now_ms(),
                "change": change or describe(current, new),
            }
        )
        data = new.model_dump_json().encode()
        try:
            if seq:
                new_seq = await kv.update(key, data, last=seq)
            else:
                new_seq = await kv.create(key, data)
        except nats.js.errors.KeyWrongLastSequenceError:
            if expected_kv_revision:
                raise RouteChanged(
                    f"route of {model!r} changed while writing; re-read it with "
                    f"`inferbus route show {model}` and apply your change again"
                ) from None
            continue
        result = RouteWrite(new, int(new_seq), current, changed=True)
        log.info(
            "route changed: %s",
            new.change,
            extra={"model": model, "revision": new.revision, "updated_by": updated_by},
        )
        if on_change is not None:
            await on_change(result)
        return result
    raise RouteChanged(
        f"route of {model!r} kept changing under {CAS_ATTEMPTS} attempts to write it; retry"
    )


@dataclass(frozen=True, slots=True)
class TrafficChange:
    """The traffic fields a `SetTraffic` call sets (None: keep)."""

    canary: str | None = None
    canary_weight: float | None = None
    shadow: str | None = None
    shadow_rate: float | None = None
    sticky: str | None = None
    pool: str | None = None


def normalise_sticky(value: str) -> str:
    """``tenant``, ``header:<Name>`` or '' (``none``/``off`` also mean off).

    Raises:
        InvalidArgument: any other value.
    """
    v = value.strip()
    if v.lower() in ("", "none", "off"):
        return ""
    if v == "tenant":
        return v
    if v.startswith("header:") and _HEADER_NAME.match(v[len("header:") :]):
        return v
    raise InvalidArgument(
        f"sticky {value!r} is not valid: use 'tenant', 'header:<Name>' (e.g. header:X-User-Id) "
        "or 'none'"
    )


def refuse_unservable(
    model: str,
    *,
    unloaded: bool,
    archived: list[str],
    versions: tuple[str, ...] = (),
    action: str = "traffic",
) -> None:
    """Refuse traffic to a model taken out of serving or to archived versions.

    Both are states an operator chose (``SetServing`` off, ``ArchiveVersion``);
    naming the state tells them what to undo, where "no routable version" would
    not.

    Args:
        model: model name.
        unloaded: the model is out of serving (its route is withdrawn).
        archived: the model's archived versions.
        versions: the versions the change sends traffic to ('' entries ignored).
        action: what is refused, for the message (e.g. ``a rollout``).

    Raises:
        FailedPrecondition: the model is unloaded, or one of `versions` is archived.
    """
    if unloaded:
        raise FailedPrecondition(
            f"{model!r} is unloaded (SetServing off): it takes no {action} until it is "
            "loaded again (SetServing on, or the repository API's load)"
        )
    for version in versions:
        if version and version in archived:
            raise FailedPrecondition(
                f"version {version!r} of {model!r} is archived: it takes no {action}; "
                f"make it usable again with `inferbus models unarchive {model} {version}`"
            )


def apply_traffic(route: Route, change: TrafficChange, versions: list[str]) -> Route:
    """`route` with `change` applied and checked.

    Args:
        route: the current route.
        change: what to set.
        versions: routable versions of the model (existing, not archived).

    Raises:
        InvalidArgument: weight or rate out of range, canary/shadow equal to
            stable, a weight without a canary, a bad stickiness key.
        NotFound: canary or shadow is not a routable version.
    """
    update: dict[str, object] = {}
    if change.canary is not None:
        update["canary"] = change.canary
        if not change.canary:
            update["canary_weight"] = 0.0
    if change.canary_weight is not None:
        if not 0.0 <= change.canary_weight <= 100.0:
            raise InvalidArgument(f"canary weight {change.canary_weight:g} is not within 0-100")
        update["canary_weight"] = float(change.canary_weight)
    if change.shadow is not None:
        update["shadow"] = change.shadow
        if not change.shadow:
            update["shadow_rate"] = 0.0
    if change.shadow_rate is not None:
        if not 0.0 <= change.shadow_rate <= 1.0:
            raise InvalidArgument(f"shadow rate {change.shadow_rate:g} is not within 0-1")
        update["shadow_rate"] = float(change.shadow_rate)
    if change.sticky is not None:
        update["sticky"] = normalise_sticky(change.sticky)
    if change.pool is not None:
        if not change.pool.strip():
            raise InvalidArgument("pool must not be empty")
        update["pool"] = change.pool.strip()
    new = route.model_copy(update=update)
    for kind in ("canary", "shadow"):
        version = getattr(new, kind)
        if not version:
            continue
        if version == new.stable:
            raise InvalidArgument(
                f"{kind} {version!r} is the stable version of {route.model!r}; pick another "
                "version (or move stable with `inferbus models alias`)"
            )
        if version not in versions:
            raise NotFound(
                f"{route.model!r} has no routable version {version!r}; versions: {versions}"
            )
    if not new.canary and new.canary_weight:
        raise InvalidArgument("a canary weight needs a canary version (--canary V)")
    if not new.shadow and new.shadow_rate:
        raise InvalidArgument("a shadow rate needs a shadow version (--shadow V)")
    return new


def route_event_fields(write: RouteWrite) -> dict[str, object]:
    """Fields of the ``route_changed`` lifecycle event of a write."""
    assert write.route is not None
    route = write.route
    return {
        "revision": route.revision,
        "kv_revision": write.kv_revision,
        "updated_by": route.updated_by,
        "updated_unix_ms": route.updated_unix_ms,
        "change": route.change,
        "route": json.loads(route.model_dump_json()),
        "previous_revision": write.previous.revision if write.previous else 0,
    }
