"""The routing decision: which version serves a request.

Reads only NATS headers and the routing table; never the body. Decisions, in
order:

1. **pinned**: the request names a version or an alias (``Ib-Version``);
2. **sticky**: the route has a stickiness key and the request carries it; the
   key is hashed (BLAKE2b of model and key, never Python's salted ``hash()``)
   into one of `STICKY_BUCKETS` buckets, and buckets below the canary weight go
   to the canary. Every router instance, before and after a restart, computes
   the same bucket, so a key always lands on the same version for a given weight;
3. **weighted**: a uniform random draw against the canary weight.

Without a canary every unpinned request goes to the stable version.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound
from inferbus_common.protocol import headers as h

STICKY_BUCKETS = 10_000
"""Resolution of sticky routing: a weight of 0.01 % moves one bucket."""

PINNED = "pinned"
STICKY = "sticky"
WEIGHTED = "weighted"
STABLE = "stable"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    Attributes:
        version: version that serves the request.
        reason: `PINNED`, `STICKY`, `WEIGHTED` or `STABLE` (no canary in play).
    """

    version: str
    reason: str


def sticky_bucket(model: str, key: str) -> int:
    """Bucket in ``[0, STICKY_BUCKETS)`` of a stickiness key for a model.

    BLAKE2b is stable across processes, hosts and Python versions (unlike
    ``hash()``, salted per process), which is what makes router instances agree.
    """
    digest = hashlib.blake2b(f"{model}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % STICKY_BUCKETS


def sticky_key(route: Route, headers: Mapping[str, str]) -> str:
    """The request's stickiness key under the route's `sticky` setting ('' = none).

    ``tenant`` reads ``Ib-Tenant``; ``header:<Name>`` reads ``Ib-Sticky-Key``,
    which the gateway copies from the client's ``<Name>`` header.
    """
    if not route.sticky:
        return ""
    if route.sticky == "tenant":
        return headers.get(h.TENANT, "")
    if route.sticky.startswith("header:"):
        return headers.get(h.STICKY_KEY, "")
    return ""


def resolve_pinned(route: Route, model: str, pinned: str) -> str:
    """The version a pinned version or alias names.

    ``stable`` and ``canary`` name the route's stable and canary versions when
    no alias of that name is set.

    Raises:
        NotFound: neither a version nor an alias of the model.
    """
    if pinned in route.aliases:
        return route.aliases[pinned]
    if pinned in route.versions:
        return pinned
    if pinned == "stable":
        return route.stable
    if pinned == "canary" and route.canary:
        return route.canary
    raise NotFound(
        f"model '{model}' has no version or alias '{pinned}'; versions: {route.versions}, "
        f"aliases: {sorted(route.aliases)}"
    )


def decide(
    route: Route | None,
    model: str,
    headers: Mapping[str, str],
    *,
    canary_weight: float | None = None,
    draw: Callable[[], float] = random.random,
) -> Decision:
    """Pick the version of one request (see the module docstring for the order).

    Args:
        route: the model's routing table (None: not deployed).
        model: model name.
        headers: the request's NATS headers.
        canary_weight: effective canary percent (0-100); defaults to the
            route's configured weight. The router passes the health-scaled one.
        draw: uniform [0, 1) source for the weighted choice (tests pass their own).

    Raises:
        NotFound: the model has no route, or the pinned version/alias is unknown.
    """
    if route is None:
        raise NotFound(f"model '{model}' is not deployed (no route)")
    pinned = headers.get(h.VERSION, "")
    if pinned:
        return Decision(resolve_pinned(route, model, pinned), PINNED)
    weight = route.canary_weight if canary_weight is None else canary_weight
    if not route.canary or route.canary == route.stable or weight <= 0:
        return Decision(route.stable, STABLE)
    key = sticky_key(route, headers)
    if key:
        hit = sticky_bucket(model, key) < weight * (STICKY_BUCKETS / 100)
        return Decision(route.canary if hit else route.stable, STICKY)
    hit = draw() * 100 < weight
    return Decision(route.canary if hit else route.stable, WEIGHTED)


def wants_shadow(route: Route, decision: Decision, draw: Callable[[], float]) -> bool:
    """Whether to send a copy of this request to the route's shadow version.

    Never when the request already goes to the shadow version itself.
    """
    if not route.shadow or route.shadow_rate <= 0 or route.shadow == decision.version:
        return False
    return draw() < route.shadow_rate


def choose_version(route: Route | None, model: str, pinned: str) -> str:
    """Version for a request on `model`, pinned (a version or an alias) or not.

    Shorthand of `decide` for callers that only have the pinned value.

    Raises:
        NotFound: the model has no route, or the pinned version/alias is unknown.
    """
    return decide(route, model, {h.VERSION: pinned} if pinned else {}).version
