"""Which requests may skip the router: the gateway sends them to a version itself."""

from __future__ import annotations

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound
from inferbus_common.resolver import decide, has_shadow


def plain_version(route: Route | None, pinned: str) -> str:
    """The version the gateway may publish a request to itself, skipping the router; ''
    when the router has something to do.

    The router has nothing to do when the version is decided without it
    (`inferbus_common.resolver.decide` without a draw: a pin, or a route with
    no canary taking traffic; the gateway sends pins as concrete versions)
    and the route copies nothing to a shadow version.
    """
    if route is None or has_shadow(route):
        return ""
    try:
        return decide(route, route.model, pinned, draw=None).version
    except NotFound:
        return ""  # the router answers it NOT_FOUND, as for any other request
