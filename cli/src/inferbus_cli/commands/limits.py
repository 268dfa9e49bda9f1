"""`inferbus limits`: show and change the cluster-wide QPS limits kept in Redis.

Every gateway reloads the limits within a second, so a change here takes
effect on the whole cluster without a restart. Scopes: ``interface`` (e.g.
``ModelInfer``; rejections say ``cluster-qps``), ``model`` (``model-qps``) and
``tenant-model`` (``tenant:model``, ``*`` allowed; ``tenant-quota``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING

from inferbus_cli.plan import redis_url
from inferbus_cli.state import load_state, resolve_home

if TYPE_CHECKING:
    from inferbus_common.admission.limits import Limit, Scope


def redis_target(args: argparse.Namespace) -> str:
    """The Redis URL: ``--redis``, else the local stack's from state.json."""
    if args.redis:
        return args.redis
    state = load_state(resolve_home(args.home))
    address = state.endpoints.get("redis") if state else None
    if not address:
        raise SystemExit(
            "no Redis address: pass --redis redis://HOST:PORT/0 or start the stack "
            "with `inferbus up` (Redis is where the limits live)"
        )
    return redis_url(address)


async def _run(args: argparse.Namespace) -> int:
    from inferbus_common.admission.keys import AdmissionKeys, connect_redis
    from inferbus_common.admission.limits import Limit, delete_limit, list_limits, set_limit

    keys = AdmissionKeys(args.prefix)
    redis = connect_redis(redis_target(args), timeout_s=5.0)
    try:
        if args.action == "set":
            limit = Limit(_scope(args.scope), args.name, qps=args.qps, burst=args.burst)
            await set_limit(redis, keys, limit)
            print(f"set {args.scope} limit {args.name}: {args.qps:g} requests/s")
        elif args.action == "delete":
            if not await delete_limit(redis, keys, _scope(args.scope), args.name):
                print(f"no {args.scope} limit named {args.name}", file=sys.stderr)
                return 1
            print(f"deleted {args.scope} limit {args.name}")
        limits = await list_limits(redis, keys)
    finally:
        await redis.aclose()
    if args.json:
        print(json.dumps([_as_dict(lim) for lim in limits], indent=2))
    elif args.action == "list":
        if not limits:
            print("no limits set (every model is unlimited)")
        for lim in limits:
            burst = "default" if lim.burst is None else f"{lim.burst:g}"
            print(
                f"{lim.scope.field_prefix:<13} {lim.name:<30} {lim.qps:>10g}/s  "
                f"burst {burst:<8} reason {lim.scope.reason}"
            )
    return 0


def _scope(name: str) -> Scope:
    from inferbus_common.admission.limits import Scope

    for scope in Scope:
        if scope.field_prefix == name:
            return scope
    raise SystemExit(f"unknown scope {name!r}; use interface, model or tenant-model")


def _as_dict(limit: Limit) -> dict[str, object]:
    return {
        "scope": limit.scope.field_prefix,
        "name": limit.name,
        "qps": limit.qps,
        "burst": limit.burst,
        "reason": limit.scope.reason,
    }


def run(args: argparse.Namespace) -> int:
    """Entry of `inferbus limits ...`."""
    return asyncio.run(_run(args))
