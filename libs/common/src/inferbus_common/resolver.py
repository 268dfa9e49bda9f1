"""The version choice: which version of a model serves a request.

One pure function, `decide`, used by the router (for every request it routes)
and by the gateway (to know which version's config to validate a request
against, and whether it may skip the router). No I/O: it reads the model's
`Route` and what the caller knows of the request. Decisions, in order:

1. **pinned**: the request names a version or an alias. A pin is looked up as
   an alias of the route first (aliases start with a letter, versions with a
   digit, so the two never collide), then as a version the route names, then
   as the route's own ``stable`` / ``canary`` fields (so a client may pin
   ``canary`` without anyone setting an alias of that name), and last as a
   version *number* through the caller's `numbers` map (Triton clients send
   integers; an exact version name wins over a number). A pin that names
   nothing is `NotFound`, naming the model, the pin and what exists.
2. **sticky**: the route has a stickiness key and the request carries it; the
   key is hashed (BLAKE2b of model and key, never Python's salted ``hash()``)
   into one of `STICKY_BUCKETS` buckets, and buckets below the canary weight go
   to the canary. Every process, before and after a restart, computes the same
   bucket, so a key always lands on the same version for a given weight.
3. **weighted**: a uniform random draw against the canary weight.

Without a canary taking traffic every unpinned request goes to ``stable``.
The weight in 2 and 3 is the caller's effective weight: the router passes the
configured weight scaled by the canary's health factor (0 while no worker has
the canary ready). A caller that has no such weight and no draw (the gateway)
passes ``draw=None``: then a choice that depends on them is left open
(`Decision.version` is ``''``, reason `SPLIT`) for the router to make.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inferbus_common.errors import NotFound

if TYPE_CHECKING:
    # Only a type here: the catalog itself resolves through this module.
    from inferbus_common.catalogrecords import Route

STICKY_BUCKETS = 10_000
"""Resolution of sticky routing: a weight of 0.01 % moves one bucket."""

PINNED = "pinned"
"""The request named a version, alias or route field."""
STICKY = "sticky"
"""Chosen by the hash of the request's stickiness key."""
WEIGHTED = "weighted"
"""Chosen by a random draw against the canary weight."""
STABLE = "stable"
"""No canary in play: the route's stable version."""
SPLIT = "split"
"""Left open: the choice needs the router's effective weight and draw."""

STABLE_FIELD = "stable"
"""Pin naming the route's `stable` field (when no alias of that name exists)."""
CANARY_FIELD = "canary"
"""Pin naming the route's `canary` field (when no alias of that name exists)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    Attributes:
        version: version that serves the request ('' when `reason` is `SPLIT`).
        reason: `PINNED`, `STICKY`, `WEIGHTED`, `STABLE` or `SPLIT`.
    """

    version: str
    reason: str

    @property
    def decided(self) -> bool:
        """Whether the version is known (not left to the router)."""
        return bool(self.version)


def sticky_bucket(model: str, key: str) -> int:
    """Bucket in ``[0, STICKY_BUCKETS)`` of a stickiness key for a model.

    BLAKE2b is stable across processes, hosts and Python versions (unlike
    ``hash()``, salted per process), which is what makes router instances agree.
    """
    digest = hashlib.blake2b(f"{model}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % STICKY_BUCKETS


def stickiness_key(route: Route | None, tenant: str, header_key: str) -> str:
    """The request's stickiness key under the route's `sticky` setting ('' = none).

    Args:
        route: the model's routing table (None: not deployed, no key).
        tenant: the request's tenant (used when `sticky` is ``tenant``).
        header_key: the value of the client header `sticky` names
            (``header:<Name>``), which the gateway copies into the request.
    """
    if route is None or not route.sticky:
        return ""
    if route.sticky == "tenant":
        return tenant
    if route.sticky.startswith("header:"):
        return header_key
    return ""


def pinned_version(
    route: Route | None, model: str, pin: str, numbers: Mapping[str, str] | None = None
) -> str:
    """The version a pin names; an empty pin names the route's stable version.

    Args:
        route: the model's routing table (None: not deployed).
        model: model name (for the error message).
        pin: a version, an alias, ``stable``/``canary`` or a version number.
        numbers: version number (decimal text) → version, when the caller
            knows the model's numbering (Triton-style integers); None: none.

    Raises:
        NotFound: the model has no route, or the pin names nothing.
    """
    if route is None:
        raise NotFound(f"Request for unknown model: '{model}' is not deployed (no route)")
    if not pin:
        if not route.stable:
            raise NotFound(f"model '{model}' has no stable version deployed")
        return route.stable
    if pin in route.aliases:
        return route.aliases[pin]
    if pin in route.versions or pin == route.stable or pin == route.canary:
        return pin
    if pin == STABLE_FIELD and route.stable:
        return route.stable
    if pin == CANARY_FIELD and route.canary:
        return route.canary
    if numbers is not None and pin.isdigit() and pin in numbers:
        return numbers[pin]
    names = sorted(route.aliases) + [
        f for f, v in ((STABLE_FIELD, route.stable), (CANARY_FIELD, route.canary)) if v
    ]
    raise NotFound(
        f"model '{model}' has no version '{pin}' and no alias '{pin}'; versions: "
        f"{route.versions}, "
        f"aliases: {sorted(set(names))}"
    )


def decide(
    route: Route | None,
    model: str,
    pin: str = "",
    *,
    sticky_key: str = "",
    canary_weight: float | None = None,
    draw: Callable[[], float] | None = random.random,
    numbers: Mapping[str, str] | None = None,
) -> Decision:
    """Pick the version of one request (see the module docstring for the order).

    Args:
        route: the model's routing table (None: not deployed).
        model: model name.
        pin: the version, alias or route field the request names ('' = none).
        sticky_key: the request's stickiness key (`stickiness_key`; '' = none).
        canary_weight: effective canary percent (0-100); defaults to the
            route's configured weight. The router passes the health-scaled one.
        draw: uniform [0, 1) source for the weighted choice (tests pass their
            own). None: the caller cannot make a weighted or sticky choice;
            one that is needed comes back as ``Decision('', SPLIT)``.
        numbers: version number → version (see `pinned_version`).

    Raises:
        NotFound: the model has no route, or the pin names nothing.
    """
    if pin:
        return Decision(pinned_version(route, model, pin, numbers), PINNED)
    stable = pinned_version(route, model, "")
    assert route is not None  # pinned_version raised otherwise
    weight = route.canary_weight if canary_weight is None else canary_weight
    if not route.canary or route.canary == stable or weight <= 0:
        return Decision(stable, STABLE)
    if draw is None:
        # The router scales the weight by the canary's health and readiness,
        # which only it knows: whatever is decided here could differ.
        return Decision("", SPLIT)
    if sticky_key:
        hit = sticky_bucket(model, sticky_key) < weight * (STICKY_BUCKETS / 100)
        return Decision(route.canary if hit else stable, STICKY)
    hit = draw() * 100 < weight
    return Decision(route.canary if hit else stable, WEIGHTED)


def wants_shadow(route: Route, decision: Decision, draw: Callable[[], float]) -> bool:
    """Whether to send a copy of this request to the route's shadow version.

    Never when the request already goes to the shadow version itself.
    """
    if not route.shadow or route.shadow_rate <= 0 or route.shadow == decision.version:
        return False
    return draw() < route.shadow_rate


def has_shadow(route: Route) -> bool:
    """Whether the route copies some requests to a shadow version (only the router can)."""
    return bool(route.shadow) and route.shadow_rate > 0
