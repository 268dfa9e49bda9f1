"""How repeatable is a canary split? (issue 21)

Starts the whole stack (`inferbus_testing.stack.LocalStack`: registry, router,
batcher, two workers, gateway) with the example fraud model. Each run pushes a
fresh version (so the canary is a freshly loaded version, whose first requests
are the slow ones that used to cut its weight), waits until it is ready, sets
it as a canary at ``--weight`` percent, sends ``--requests`` unpinned requests
over KServe V2 gRPC with ``--concurrency`` clients, counts which version
answered, and clears the canary. Reports each run's canary share and how many
runs are within ``--tolerance`` points of the weight.

Usage::

    uv run python bench/canary_split.py                  # 20 runs of 5,000 requests at 10 %
    uv run python bench/canary_split.py --runs 3 --requests 1000

Raw results go to ``bench/results/canary-split-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from inferbus_client.registry import RegistryClient
from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[1]


async def _wait_ready(client: grpcaio.InferenceServerClient, version: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await client.is_model_ready("fraud", version):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fraud {version} not ready after {timeout}s")
        await asyncio.sleep(0.05)


async def _one_run(
    stack: LocalStack,
    registry: RegistryClient,
    client: grpcaio.InferenceServerClient,
    model_dir: Path,
    version: str,
    args: argparse.Namespace,
) -> dict[str, object]:
    await registry.push(model_dir, "fraud", version)
    await _wait_ready(client, version, 60)
    await registry.set_traffic(
        "fraud", canary=version, canary_weight=args.weight, updated_by="bench"
    )
    await asyncio.sleep(0.5)  # every gateway and router follows the route change
    x = np.zeros((1, 64), np.float32)
    counts: dict[str, int] = {}
    failures: dict[str, int] = {}
    sent = 0

    async def sender() -> None:
        nonlocal sent
        while sent < args.requests:
            sent += 1
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            try:
                result = await client.infer("fraud", [inp], timeout=10_000_000)
            except InferenceServerException as exc:
                failures[exc.status()] = failures.get(exc.status(), 0) + 1
                continue
            v = result.get_response().model_version
            counts[v] = counts.get(v, 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(sender() for _ in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    await registry.set_traffic("fraud", canary="", updated_by="bench")
    answered = sum(counts.values())
    share = 100.0 * counts.get(version, 0) / answered if answered else 0.0
    factor = stack.metrics(stack.router).get(
        f"inferbus_router_canary_health_factor{{model=fraud,version={version}}}", 1.0
    )
    return {
        "version": version,
        "answered": answered,
        "failed": failures,
        "canary_share_pct": round(share, 2),
        "seconds": round(elapsed, 2),
        "router_factor_at_end": factor,
    }


def _make_model(out: Path) -> Path:
    subprocess.run(
        [sys.executable, str(REPO / "examples/fraud/make_model.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


async def _main(args: argparse.Namespace, base: Path, model_dir: Path) -> int:
    runs: list[dict[str, object]] = []
    try:
        with LocalStack(base, workers=2, env={"INFERBUS_WORKER_UNLOAD_GRACE_S": "1"}) as stack:
            client = grpcaio.InferenceServerClient(stack.grpc_url)
            async with RegistryClient(stack.registry_url) as registry:
                await registry.push(model_dir, "fraud", "1", aliases=["stable"])
                await _wait_ready(client, "1", 60)
                for i in range(args.runs):
                    run = await _one_run(stack, registry, client, model_dir, str(i + 2), args)
                    runs.append(run)
                    print(json.dumps(run), flush=True)
            await client.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    shares = [float(r["canary_share_pct"]) for r in runs]  # type: ignore[arg-type]
    within = sum(1 for s in shares if abs(s - args.weight) <= args.tolerance)
    summary = {
        "weight_pct": args.weight,
        "requests_per_run": args.requests,
        "runs": len(runs),
        "within_tolerance": within,
        "tolerance_points": args.tolerance,
        "min_pct": min(shares),
        "max_pct": max(shares),
        "mean_pct": round(statistics.fmean(shares), 2),
        "stdev_pct": round(statistics.pstdev(shares), 2),
        "failed_requests": sum(sum(r["failed"].values()) for r in runs),  # type: ignore[union-attr]
    }
    print(json.dumps(summary, indent=2))
    out = REPO / "bench/results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"canary-split-{stamp}.json").write_text(
        json.dumps({"summary": summary, "runs": runs}, indent=2)
    )
    return 0 if within == len(runs) else 1


def main() -> None:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--weight", type=float, default=10.0)
    parser.add_argument("--tolerance", type=float, default=1.5)
    parser.add_argument("--concurrency", type=int, default=16)
    base = Path(tempfile.mkdtemp(prefix="ib-canary-split-"))
    model_dir = _make_model(base / "fraud-model")
    sys.exit(asyncio.run(_main(parser.parse_args(), base, model_dir)))


if __name__ == "__main__":
    main()
