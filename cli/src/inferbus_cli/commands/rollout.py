"""``inferbus rollout start|status|pause|resume|abort|rollback``: progressive rollouts."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from inferbus_cli.release import call, identity, when
from inferbus_cli.table import format_table
from inferbus_proto.registry import registry_pb2 as rpb


def _print(doc: dict[str, Any]) -> None:
    steps = ",".join(f"{w:g}" for w in doc["steps"])
    print(f"rollout {doc['id']}: {doc['model']} {doc['previous_stable']} -> {doc['version']}")
    print(f"state:    {doc['state']}" + (f" ({doc['reason']})" if doc.get("reason") else ""))
    print(
        f"step:     {doc['step'] + 1}/{len(doc['steps'])} at {doc['steps'][doc['step']]:g}% "
        f"(steps {steps}, every {doc['interval_s']:g}s)"
    )
    print(
        f"checks:   error rate <= {doc['max_error_rate']:g}, p99 <= {doc['max_p99_ratio']:g} x "
        f"stable, min {doc['min_requests']} requests per step, on fail: {doc['on_fail']}"
    )
    print(f"started:  {when(doc['created_unix_ms'])} by {doc.get('started_by') or '-'}")
    if doc.get("state") in ("running", "paused") and not doc.get("ready_unix_ms"):
        print(f"canary:   warming up (weight 0 until a worker reports {doc['version']} ready)")
    rows = [
        [
            h["step"],
            f"{h['weight']:g}%",
            when(h["started_unix_ms"]),
            h["outcome"],
            f"{h['canary']['requests']}/{h['canary']['errors']}/{h['canary']['p99_ms']:g}",
            f"{h['stable']['requests']}/{h['stable']['errors']}/{h['stable']['p99_ms']:g}",
            h.get("reason") or "-",
        ]
        for h in doc.get("history", [])
    ]
    if rows:
        print()
        print(
            format_table(
                [
                    "STEP",
                    "WEIGHT",
                    "STARTED",
                    "OUTCOME",
                    "CANARY n/err/p99",
                    "STABLE n/err/p99",
                    "REASON",
                ],
                rows,
            )
        )


def _show(state: rpb.RolloutState | None, as_json: bool) -> int:
    if state is None:
        return 1
    doc = json.loads(state.rollout_json)
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        _print(doc)
    return 0


def run_start(args: argparse.Namespace) -> int:
    """Start a rollout."""
    request = rpb.StartRolloutRequest(
        model=args.model,
        version=args.version,
        steps=args.steps,
        interval_s=args.interval,
        max_error_rate=args.max_error_rate,
        max_p99_ratio=args.max_p99_ratio,
        min_requests=args.min_requests,
        on_fail=args.on_fail,
        requested_by=identity(args),
        ready_timeout_s=args.ready_timeout,
    )
    state = call(
        args, f"StartRollout {args.model}", lambda s: s.StartRollout(request, timeout=args.timeout)
    )
    return _show(state, args.json)


def run_status(args: argparse.Namespace) -> int:
    """Print the model's latest rollout."""
    state = call(
        args,
        f"GetRollout {args.model}",
        lambda s: s.GetRollout(rpb.GetRolloutRequest(model=args.model), timeout=args.timeout),
    )
    return _show(state, args.json)


def run_control(args: argparse.Namespace) -> int:
    """pause | resume | abort | rollback."""
    request = rpb.ControlRolloutRequest(
        model=args.model,
        action=args.action,
        requested_by=identity(args),
        reason=args.reason or "",
    )
    state = call(
        args,
        f"rollout {args.action} {args.model}",
        lambda s: s.ControlRollout(request, timeout=args.timeout),
    )
    if state is not None and not args.json:
        print(f"{args.action}: done", file=sys.stderr)
    return _show(state, args.json)
