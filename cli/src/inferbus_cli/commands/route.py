"""``inferbus route show|set``: a model's routing table, its revisions, and traffic changes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inferbus_cli.release import call, identity, when
from inferbus_cli.table import format_table
from inferbus_common.catalog import Route
from inferbus_proto.registry import registry_pb2 as rpb


def _summary(route: Route, kv_revision: int) -> str:
    aliases = ",".join(f"{a}={v}" for a, v in sorted(route.aliases.items())) or "-"
    canary = f"{route.canary} @ {route.canary_weight:g}%" if route.canary else "-"
    shadow = f"{route.shadow} @ {route.shadow_rate:g}" if route.shadow else "-"
    return "\n".join(
        [
            f"model:    {route.model}",
            f"revision: {route.revision} (KV revision {kv_revision}; pass it to "
            "`route set --expect-revision` for a compare-and-set)",
            f"updated:  {when(route.updated_unix_ms)} by {route.updated_by or '-'}: "
            f"{route.change or '-'}",
            f"stable:   {route.stable} (pool {route.pool})",
            f"canary:   {canary}",
            f"shadow:   {shadow}",
            f"sticky:   {route.sticky or 'off'}",
            f"versions: {','.join(route.versions) or '-'}",
            f"aliases:  {aliases}",
        ]
    )


def _history_table(history: list[Route]) -> str:
    rows = [
        [
            r.revision,
            when(r.updated_unix_ms),
            r.updated_by or "-",
            r.stable,
            f"{r.canary}@{r.canary_weight:g}%" if r.canary else "-",
            f"{r.shadow}@{r.shadow_rate:g}" if r.shadow else "-",
            r.sticky or "-",
            r.change or "-",
        ]
        for r in history
    ]
    return format_table(
        ["REV", "UPDATED", "BY", "STABLE", "CANARY", "SHADOW", "STICKY", "CHANGE"], rows
    )


def run_show(args: argparse.Namespace) -> int:
    """Print the route, its revision and its recent history."""
    state = call(
        args,
        f"GetRoute {args.model}",
        lambda stub: stub.GetRoute(
            rpb.GetRouteRequest(model=args.model, history=args.history), timeout=args.timeout
        ),
    )
    if state is None:
        return 1
    route = Route.model_validate_json(state.route_json)
    history = [Route.model_validate_json(h) for h in state.history_json]
    if args.json:
        doc = {
            "route": json.loads(route.model_dump_json()),
            "kv_revision": state.kv_revision,
            "history": [json.loads(r.model_dump_json()) for r in history],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(_summary(route, state.kv_revision))
    if history:
        print("\nhistory (newest first, from the routes bucket):")
        print(_history_table([route, *history]))
    return 0


def run_set(args: argparse.Namespace) -> int:
    """Change canary/shadow/sticky/pool (compare-and-set when --expect-revision is given)."""
    fields: dict[str, Any] = {}
    for arg, field in (
        ("canary", "canary"),
        ("weight", "canary_weight"),
        ("shadow", "shadow"),
        ("shadow_rate", "shadow_rate"),
        ("sticky", "sticky"),
        ("pool", "pool"),
    ):
        value = getattr(args, arg)
        if value is not None:
            fields[field] = value
    if not fields:
        print(
            "error: nothing to change (give --canary, --weight, --shadow, --shadow-rate, "
            "--sticky or --pool)",
            file=sys.stderr,
        )
        return 2
    request = rpb.SetTrafficRequest(
        model=args.model,
        expected_kv_revision=args.expect_revision or 0,
        updated_by=identity(args),
        change=args.message or "",
        force=getattr(args, "force", False),
        **fields,
    )
    state = call(
        args,
        f"SetTraffic {args.model}",
        lambda stub: stub.SetTraffic(request, timeout=args.timeout),
    )
    if state is None:
        return 1
    route = Route.model_validate_json(state.route_json)
    if args.json:
        print(
            json.dumps(
                {"route": json.loads(route.model_dump_json()), "kv_revision": state.kv_revision},
                indent=2,
            )
        )
        return 0
    print(_summary(route, state.kv_revision))
    return 0
