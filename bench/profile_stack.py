"""Profile the inferbus stack under load, and A/B two configurations in one run.

Starts the stack (`bench/stack.py`) once per *arm* (an arm is a name plus
environment settings for the services), pushes the example fraud model (or
the heavy MLP, ``--model heavy``), and runs ``bench/loadgen.py`` at each
concurrency. While a run is measured, the
in-process sampler (``bench/sampler/sitecustomize.py``) records every service's
busy stacks and CPU time, so each run also reports CPU per request by process
and the top frames (same summary as ``render.py`` makes of py-spy output).

Arms alternate (A, B, A, B, ...) for ``--rounds`` rounds so that load from
other jobs on the shared machine falls on both; the summary reports each arm's
median and the B/A ratios::

    uv run python bench/profile_stack.py --concurrency 1 64 --duration 8 \\
        --arm 'base:INFERBUS_GATEWAY_ACCESS_LOG=true' --arm 'new:' --rounds 2

With ``--rate R`` the runs are open loop at R requests/s instead (the same
work per second in every arm). Each run also records the batch fill over its
measured part (rows per micro-batch and per engine execution, and the share
of micro-batches the batcher sent at once on a worker's idle signal): CPU per
request in the batcher and the workers follows the fill, so arms only
compare at similar fills.

One JSON line per measured run (``kind: profile_run``) and one per arm
comparison (``kind: ab``) go to ``--out`` (default
``bench/results/profile-<time>.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from cpu_window import nats_msgs, proc_cpu_s
from record import cpu_jiffies
from render import summarize_collapsed
from stack import BenchStack

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SAMPLER = Path(__file__).resolve().parent / "sampler"


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """``name:KEY=V,KEY2=V2`` → (name, env); ``|`` separates instead of ``,`` when
    present (for values with commas: ``name:A=[1,2]|B=3``)."""
    name, _, rest = text.partition(":")
    env: dict[str, str] = {}
    for item in filter(None, rest.split("|" if "|" in rest else ",")):
        key, _, value = item.partition("=")
        env[key.strip()] = value.strip()
    return name, env


def loadgen_argv(
    url: str, model: str, load: str, duration: float, warmup: float, channels: int = 1
) -> list[str]:
    """`bench/loadgen.py`'s command line for one gRPC run: closed loop (`load` ``c<N>``)
    or open loop (``r<req/s>``); run from the repository root."""
    return [
        PYTHON,
        "bench/loadgen.py",
        "--url",
        url,
        "--model",
        model,
        "--rate" if load.startswith("r") else "--concurrency",
        load[1:],
        "--duration",
        str(duration),
        "--warmup",
        str(warmup),
        "--channels",
        str(channels),
    ]


def loadgen(
    url: str, model: str, load: str, duration: float, warmup: float, channels: int = 1
) -> dict:
    """One gRPC run, closed loop (`load` ``c<N>``) or open loop (``r<req/s>``); its JSON line."""
    argv = loadgen_argv(url, model, load, duration, warmup, channels)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise RuntimeError(f"{shlex.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return lines[-1]


def counter_total(stack: BenchStack, service_prefix: str, metric: str) -> float:
    """A Prometheus counter summed over every process of a service."""
    total = 0.0
    for name, proc in stack.procs.items():
        if name.startswith(service_prefix):
            text = httpx.get(f"http://127.0.0.1:{proc.ports['metrics']}/metrics", timeout=5.0).text
            for line in text.splitlines():
                if line.startswith(metric + " ") or line.startswith(metric + "{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


_IDLE_DISPATCHES = "inferbus_batcher_idle_dispatches_total"


def sampled_run(
    stack: BenchStack,
    sample_dir: Path,
    label: str,
    model: str,
    load: str,
    duration: float,
    warmup: float,
    channels: int = 1,
) -> dict[str, Any]:
    """A loadgen run with the sampler on in every service for its measured window."""
    names = {pid: name for name, pid in stack.pids().items()}

    fills: dict[str, tuple[float, float]] = {}

    # The sampler window starts after the warm-up and stays inside the measured part.
    nats_pid = stack.nats.pid if stack.nats is not None else None

    def arm_sampler() -> None:
        time.sleep(warmup + 0.5)
        window = max(duration - 1.0, 1.0)
        (sample_dir / "go").write_text(f"{label} {window}")
        # nats-server is not Python: its CPU comes from /proc over the same window.
        if nats_pid is not None and stack.nats is not None:
            port = stack.nats.monitor_port
            t0, c0 = time.monotonic(), proc_cpu_s(nats_pid)
            v0 = nats_msgs(port)
            j0 = cpu_jiffies()
            time.sleep(window)
            fills["nats"] = (proc_cpu_s(nats_pid) - c0, time.monotonic() - t0)
            j1 = cpu_jiffies()
            if j0 and j1 and j1[1] > j0[1]:
                # A virtual machine's CPUs taken by its host (steal): a run with a
                # high share measured a machine that was not all there.
                fills["steal"] = ((j1[0] - j0[0]) / (j1[1] - j0[1]), 0.0)
            v1 = nats_msgs(port)
            if v0 and v1:
                fills["msgs"] = (v1[0] - v0[0], v1[1] - v0[1], time.monotonic() - t0)
        with contextlib.suppress(httpx.HTTPError):
            fills["batch"] = stack.batch_rows()
            fills["engine"] = stack.engine_rows()
            fills["idle"] = (counter_total(stack, "batcher", _IDLE_DISPATCHES), 0.0)

    import threading

    t = threading.Thread(target=arm_sampler, daemon=True)
    t.start()
    line = loadgen(stack.grpc_url, model, load, duration, warmup, channels)
    t.join()
    # Batch fill over the measured part: CPU per request falls as micro-batches
    # grow, so arms are only comparable at similar fills.
    fill: dict[str, float | None] = {}
    with contextlib.suppress(httpx.HTTPError):
        for key, read in (("batch", stack.batch_rows), ("engine", stack.engine_rows)):
            if key in fills:
                s1, n1 = read()
                s0, n0 = fills[key]
                fill[f"rows_per_{key}"] = round((s1 - s0) / (n1 - n0), 2) if n1 > n0 else None
        if "idle" in fills and "batch" in fills:
            # Share of micro-batches sent at once on a worker's idle signal.
            idle = counter_total(stack, "batcher", _IDLE_DISPATCHES) - fills["idle"][0]
            batches = stack.batch_rows()[1] - fills["batch"][1]
            fill["idle_dispatch_share"] = round(idle / batches, 3) if batches else None
    deadline = time.monotonic() + 10
    procs: dict[str, Any] = {}
    while time.monotonic() < deadline:
        found = list(sample_dir.glob(f"{label}-*.json"))
        if len(found) >= len(names):
            break
        time.sleep(0.2)
    served = line["throughput_rps"] * 1.0
    for meta_path in sample_dir.glob(f"{label}-*.json"):
        meta = json.loads(meta_path.read_text())
        name = names.get(meta["pid"], str(meta["pid"]))
        if name == "registry":
            continue
        busy = meta["cpu_s"] / meta["wall_s"]
        info: dict[str, Any] = {
            "busy_core": round(busy, 3),
            "cpu_us_per_req": round(1e6 * busy / served, 1) if served else None,
        }
        txt = meta_path.with_suffix(".txt")
        if txt.exists() and txt.stat().st_size:
            info |= summarize_collapsed(txt.read_text(), top=12)
        # cProfile (INFERBUS_SAMPLE_MODE=cprofile): seconds → microseconds per answered request.
        n = served * meta["wall_s"]
        for key in ("top_tottime", "top_cumtime"):
            if key in meta and n:
                info[key] = [
                    [f, calls / n, round(1e6 * tt / n, 2), round(1e6 * ct / n, 2)]
                    for f, calls, tt, ct in meta[key]
                ]
        procs[name] = info
    if "nats" in fills and served:
        busy = fills["nats"][0] / fills["nats"][1]
        procs["nats-server"] = {
            "busy_core": round(busy, 3),
            "cpu_us_per_req": round(1e6 * busy / served, 1),
        }
    if "steal" in fills:
        fill["steal_share"] = round(fills["steal"][0], 3)
    if "msgs" in fills and served:
        # Bus messages per answered request over the same window: published to
        # nats-server (in) and delivered by it (out), JetStream's own included.
        n_in, n_out, wall = fills["msgs"]
        fill["msgs_in_per_req"] = round(n_in / (served * wall), 2)
        fill["msgs_out_per_req"] = round(n_out / (served * wall), 2)
    return {"line": line, "procs": procs, "fill": fill}


def join_gateways(stack: BenchStack, gateways: int) -> None:
    """Start gateway processes 2..`gateways` on the first one's HTTP and gRPC ports."""
    for i in range(2, gateways + 1):
        stack._spawn(
            f"gateway{i}",
            "inferbus_gateway",
            {
                "INFERBUS_GATEWAY_HTTP_PORT": str(stack.gateway.ports["http"]),
                "INFERBUS_GATEWAY_GRPC_PORT": str(stack.gateway.ports["grpc"]),
                "INFERBUS_GATEWAY_PORT_GROUP": "join",
                "INFERBUS_GATEWAY_REGISTRY_URL": stack.registry_url,
            },
        ).wait_ready()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", default=None, help="name:KEY=V,... (repeatable)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        help="open loop at these req/s instead of the closed-loop concurrencies: the same "
        "work per second in every arm, so CPU per request compares at like batch fills",
    )
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--model",
        choices=["fraud", "heavy"],
        default="fraud",
        help="example fraud MLP, or the heavy MLP of bench/models/make_heavy.py",
    )
    p.add_argument(
        "--channels",
        type=int,
        default=1,
        help="gRPC channels of the load generator (several connections: with gateway "
        "processes sharing a port, one connection is served by one process)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--top", type=int, default=6, help="frames printed per process")
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in (args.arm or ["default:"])]
    loads = [f"r{r:g}" for r in args.rate] if args.rate else [f"c{c}" for c in args.concurrency]
    out = args.out or REPO / "bench/results" / f"profile-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="inferbus-profile-") as tmp:
        work = Path(tmp)
        model_dir = work / args.model
        maker = (
            "examples/fraud/make_model.py"
            if args.model == "fraud"
            else "bench/models/make_heavy.py"
        )
        subprocess.run(
            [PYTHON, maker, "--out", str(model_dir)], check=True, capture_output=True, cwd=REPO
        )
        for rnd in range(args.rounds):
            for name, env in arms:
                sample_dir = work / f"samples-{name}-{rnd}"
                sample_dir.mkdir()
                # An arm's PYTHONPATH (e.g. a `git archive` of another revision's
                # libs/*/src and services/*/src) goes after the sampler.
                paths = [str(SAMPLER), *filter(None, [env.get("PYTHONPATH", "")])]
                # BENCH_GATEWAYS=N in an arm: N gateway processes on one port (issue 31).
                gateways = int(env.get("BENCH_GATEWAYS", "1"))
                stack_env = {
                    **{k: v for k, v in env.items() if k != "BENCH_GATEWAYS"},
                    "PYTHONPATH": ":".join(paths),
                    "INFERBUS_SAMPLE_DIR": str(sample_dir),
                }
                base = work / f"stack-{name}-{rnd}"
                if gateways > 1:
                    stack_env["INFERBUS_GATEWAY_PORT_GROUP"] = "first"
                with BenchStack(base, workers=args.workers, env=stack_env) as stack:
                    join_gateways(stack, gateways)
                    stack.push(model_dir, args.model)
                    stack.wait_model_ready(args.model)
                    for c in loads:
                        label = f"{name}-{c}"
                        run = sampled_run(
                            stack,
                            sample_dir,
                            label,
                            args.model,
                            c,
                            args.duration,
                            args.warmup,
                            args.channels,
                        )
                        record = {
                            "kind": "profile_run",
                            "model": args.model,
                            "arm": name,
                            "env": env,
                            "round": rnd,
                            "concurrency": int(c[1:]) if c.startswith("c") else None,
                            "rate": float(c[1:]) if c.startswith("r") else None,
                            "load": list(os.getloadavg()),
                        } | run
                        with out.open("a") as f:
                            f.write(json.dumps(record) + "\n")
                        results.setdefault((name, c), []).append(record)
                        line = run["line"]
                        stages = {k: v.get("mean_us") for k, v in line.get("stages", {}).items()}
                        print(
                            f"[{name} r{rnd} {c}] {line['throughput_rps']:.1f} req/s"
                            f" p50 {line['latency_ms']['p50']} p99 {line['latency_ms']['p99']} ms"
                            f" errors {line['errors']} stages(us) {stages}"
                            f" rows per micro-batch / engine run {run['fill']}",
                            flush=True,
                        )
                        for proc, info in sorted(run["procs"].items()):
                            print(
                                f"   {proc:9s} busy {info['busy_core']:.2f} core,"
                                f" {info['cpu_us_per_req']} us/req,"
                                f" {info.get('samples', '-')} samples",
                                flush=True,
                            )
                            for frame, share in info.get("top_self", [])[: args.top]:
                                print(f"      self {share:5.1f}%  {frame}", flush=True)
                            for frame, calls, tt, ct in info.get("top_tottime", [])[: args.top]:
                                print(
                                    f"      tot {tt:7.1f} us/req cum {ct:7.1f}"
                                    f" calls/req {calls:.2f}  {frame}",
                                    flush=True,
                                )
    if len(arms) >= 2:
        base = arms[0][0]
        for name, _ in arms[1:]:
            for c in loads:
                a = results.get((base, c), [])
                b = results.get((name, c), [])
                if not a or not b:
                    continue

                def med(rs: list[dict[str, Any]], key: str) -> float:
                    if key == "rps":
                        return statistics.median(r["line"]["throughput_rps"] for r in rs)
                    return statistics.median(r["line"]["latency_ms"][key] for r in rs)

                def cpu(rs: list[dict[str, Any]]) -> float:
                    return statistics.median(
                        sum(p["cpu_us_per_req"] or 0 for p in r["procs"].values()) for r in rs
                    )

                ab = {
                    "kind": "ab",
                    "a": base,
                    "b": name,
                    "load": c,
                    "rounds": args.rounds,
                    "rps": [med(a, "rps"), med(b, "rps")],
                    "p50_ms": [med(a, "p50"), med(b, "p50")],
                    "p99_ms": [med(a, "p99"), med(b, "p99")],
                    "cpu_us_per_req": [cpu(a), cpu(b)],
                }
                ab["ratio_rps"] = round(ab["rps"][1] / ab["rps"][0], 3)
                ab["ratio_p50"] = round(ab["p50_ms"][1] / ab["p50_ms"][0], 3)
                ab["ratio_cpu"] = round(ab["cpu_us_per_req"][1] / ab["cpu_us_per_req"][0], 3)
                with out.open("a") as f:
                    f.write(json.dumps(ab) + "\n")
                print(json.dumps(ab), flush=True)
    print(f"results: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
