"""``inferbus pools [list]`` and ``inferbus pools set``: the pool ledger and quotas."""

from __future__ import annotations

import argparse
import json
from typing import Any

from inferbus_cli.release import call, identity, when
from inferbus_cli.table import format_table
from inferbus_proto.registry import registry_pb2 as rpb


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}G" if n else "-"


def pool_to_json(p: rpb.PoolInfo) -> dict[str, Any]:
    """A ledger line as a JSON-ready dict."""
    return {
        "name": p.name,
        "configured": p.configured,
        "state": p.state,
        "max_workers": p.max_workers,
        "max_gpus": p.max_gpus,
        "total_gpus": p.total_gpus,
        "queue_lag": p.queue_lag,
        "placed": list(p.placed),
        "updated_by": p.updated_by,
        "updated_unix_ms": p.updated_unix_ms,
        "workers": [
            {
                "worker_id": w.worker_id,
                "host": w.host,
                "cpus": w.cpus,
                "memory_bytes": w.memory_bytes,
                "gpu_type": w.gpu_type,
                "gpu_count": w.gpu_count,
                "admitted": w.admitted,
                "reason": w.reason,
                "models": dict(w.models),
            }
            for w in p.workers
        ],
    }


def _print(pools: list[rpb.PoolInfo]) -> None:
    rows = [
        [
            p.name,
            p.state + ("" if p.configured else " (default)"),
            f"{sum(w.admitted for w in p.workers)}/{p.max_workers or '∞'}",
            f"{p.total_gpus}/{p.max_gpus or '∞'}",
            p.queue_lag,
            ", ".join(p.placed) or "-",
        ]
        for p in pools
    ]
    print(format_table(["POOL", "STATE", "WORKERS", "GPUS", "LAG", "PLACED"], rows))
    workers = [
        [
            p.name,
            w.worker_id,
            w.host or "-",
            w.cpus or "-",
            _gib(w.memory_bytes),
            f"{w.gpu_count} x {w.gpu_type}" if w.gpu_count else "-",
            "yes" if w.admitted else f"no: {w.reason}",
            ", ".join(f"{k}={v}" for k, v in sorted(w.models.items())) or "-",
        ]
        for p in pools
        for w in p.workers
    ]
    if workers:
        print()
        print(
            format_table(
                ["POOL", "WORKER", "HOST", "CPUS", "MEMORY", "GPUS", "ADMITTED", "MODELS"], workers
            )
        )


def run_list(args: argparse.Namespace) -> int:
    """Print the ledger."""
    resp = call(
        args, "ListPools", lambda s: s.ListPools(rpb.ListPoolsRequest(), timeout=args.timeout)
    )
    if resp is None:
        return 1
    pools = list(resp.pools)
    if args.json:
        print(json.dumps([pool_to_json(p) for p in pools], indent=2))
    elif not pools:
        print("no pools (no workers, no versions placed, none configured)")
    else:
        _print(pools)
    return 0


def run_set(args: argparse.Namespace) -> int:
    """Create or change a pool."""
    fields: dict[str, Any] = {}
    if args.max_workers is not None:
        fields["max_workers"] = args.max_workers
    if args.max_gpus is not None:
        fields["max_gpus"] = args.max_gpus
    if args.state is not None:
        fields["state"] = args.state
    request = rpb.SetPoolRequest(name=args.pool, updated_by=identity(args), **fields)
    info = call(args, f"SetPool {args.pool}", lambda s: s.SetPool(request, timeout=args.timeout))
    if info is None:
        return 1
    if args.json:
        print(json.dumps(pool_to_json(info), indent=2))
    else:
        print(
            f"pool {info.name}: state {info.state}, max_workers {info.max_workers or 'unlimited'}, "
            f"max_gpus {info.max_gpus or 'unlimited'} (by {info.updated_by}, "
            f"{when(info.updated_unix_ms)})"
        )
    return 0
