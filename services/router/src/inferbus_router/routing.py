"""The routing decision: which version serves a request.

Reads only NATS headers and the routing table; never the body.
"""

from __future__ import annotations

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound


def choose_version(route: Route | None, model: str, pinned: str) -> str:
    """Version for a request on `model`, pinned (a version or an alias) or not.

    Raises:
        NotFound: the model has no route, or the pinned version/alias is unknown.
    """
    if route is None:
        raise NotFound(f"model '{model}' is not deployed (no route)")
    if not pinned:
        return route.stable
    if pinned in route.aliases:
        return route.aliases[pinned]
    if pinned in route.versions:
        return pinned
    raise NotFound(
        f"model '{model}' has no version or alias '{pinned}'; versions: {route.versions}, "
        f"aliases: {sorted(route.aliases)}"
    )
