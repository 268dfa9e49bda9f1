"""Run the reliability suite and write ``docs/reliability.md`` (issue #11).

One command, three parts, each against real processes on this machine:

1. the fault matrix (`inferbus_testing.chaos.FAULTS`) under closed-loop load:
   sent, answered correctly, explicit errors, lost, hung, recovery time; then
   the faults with every client calling through the gRPC edge (`EDGE_FAULTS`);
2. open-loop overload at 2x and 5x the measured capacity of a compute-bound
   model (`inferbus_testing.overload`);
3. the hostile-input fuzzers (``tests/fuzz``, hypothesis) with
   ``--fuzz-examples`` examples per protocol.

Usage::

    uv run python bench/reliability.py                 # full: ~10-15 minutes on 2 cores
    uv run python bench/reliability.py --quick         # the CI-sized runs (~4 minutes)
    uv run python bench/reliability.py --skip-fuzz     # matrix and overload only

Raw results go to ``bench/results/reliability-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from inferbus_testing.chaos import (
    CLUSTER_FAULTS,
    EDGE_FAULTS,
    FAULTS,
    SLOW_MODEL,
    SLOW_SIDE,
    ChaosStack,
    ClusterChaosStack,
    Shape,
    ready_stack,
    run_fault,
)
from inferbus_testing.overload import measure_capacity, run_flood

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
RESULTS = REPO / "bench" / "results"


def run_matrix_and_overload(
    quick: bool, flood_s: float
) -> tuple[list[dict], list[dict], list[dict]]:
    """Start one `ChaosStack` (the edge in front of its gateways), run every fault,
    the edge's faults, then the floods; return their rows."""
    shape = Shape.ci() if quick else Shape.long()
    faults: list[dict[str, Any]] = []
    edge: list[dict[str, Any]] = []
    floods: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ib-reliability-") as tmp:
        with ready_stack(ChaosStack, Path(tmp), with_slow=True, edge=True) as stack:
            for rows, matrix, through_edge in ((faults, FAULTS, False), (edge, EDGE_FAULTS, True)):
                for fault in matrix.values():
                    crashes_before = len(stack.start_crashes)
                    report = asyncio.run(run_fault(stack, fault, shape, through_edge=through_edge))
                    row = report.row()
                    row["samples"] = report.samples
                    row["start_crashes"] = [
                        service for service, _ in stack.start_crashes[crashes_before:]
                    ]
                    rows.append(row)
                    brief = json.dumps({k: row[k] for k in _BRIEF})
                    print(f"{fault.name}: {brief}", flush=True)
            for factor in (2.0, 5.0):

                async def flood(factor: float = factor) -> dict[str, Any]:
                    capacity = await measure_capacity(stack, SLOW_MODEL, seconds=3.0)
                    report = await run_flood(
                        stack,
                        SLOW_MODEL,
                        rate=factor * capacity,
                        seconds=flood_s,
                        deadline_s=2.0,
                        capacity_rps=capacity,
                    )
                    row = report.row()
                    row["factor"] = factor
                    row["samples"] = report.samples
                    return row

                row = asyncio.run(flood())
                floods.append(row)
                print(f"overload {factor:g}x: {json.dumps(row)}", flush=True)
    return faults, edge, floods


_BRIEF = ("sent", "correct", "errors", "lost", "hung", "first_ok_s", "recovered_s")


def run_cluster_faults(quick: bool) -> list[dict]:
    """Start a `ClusterChaosStack` (NATS as three nodes) and run the node-loss faults."""
    shape = Shape.ci() if quick else Shape.long()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ib-reliability-cluster-") as tmp:
        with ready_stack(ClusterChaosStack, Path(tmp)) as stack:
            for fault in CLUSTER_FAULTS.values():
                report = asyncio.run(run_fault(stack, fault, shape))
                row = report.row()
                row["samples"] = report.samples
                rows.append(row)
                brief = {k: row[k] for k in (*_BRIEF, "first_ok_after_fault_s")}
                print(f"{fault.name}: {json.dumps(brief)}", flush=True)
    return rows


def run_fuzz(examples: int) -> dict[str, Any]:
    """Run ``tests/fuzz`` with `examples` per test; counts per protocol and the verdict."""
    with tempfile.TemporaryDirectory(prefix="ib-fuzz-") as tmp:
        report = Path(tmp) / "fuzz.jsonl"
        env = {
            **os.environ,
            "INFERBUS_FUZZ_EXAMPLES": str(examples),
            "INFERBUS_FUZZ_REPORT": str(report),
        }
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/fuzz", "-q", "-p", "no:cacheprovider",
             "-o", "timeout=0"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )  # fmt: skip
        seconds = time.monotonic() - t0
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        failures: list[str] = []
        if report.exists():
            for line in report.read_text().splitlines():
                entry = json.loads(line)
                counts[entry["kind"]].update(entry["counts"])
                failures += entry.get("failures", [])
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"fuzz: {tail} in {seconds:.0f} s", flush=True)
    return {
        "examples_per_test": examples,
        "seconds": round(seconds, 1),
        "exit_code": proc.returncode,
        "pytest": tail,
        "counts": {k: dict(v) for k, v in counts.items()},
        "failures": failures[:10],
    }


def _render_cluster(rows: list[dict]) -> list[str]:
    """The "NATS cluster: losing a node" section."""
    out = [
        "## NATS cluster: losing a node",
        "",
        "Stack: NATS as three nodes with clustered JetStream, every service given all "
        "three URLs and `JETSTREAM_REPLICAS=3` (work queue, audit stream and catalog "
        "buckets keep a replica on each node; the workers' durable consumers inherit "
        "it); registry (local store), router, batcher, two workers, two gateways, Redis. "
        "Load and columns as above; **first OK after the fault**: from the kill to the "
        "first correct answer to a request sent after it, while the node is still down "
        "(the two nodes left serve on their own). The node is started again after the "
        "hold, on its ports and store, and the heal returns once it is current with the "
        "cluster. The same faults, shorter, run in `tests/chaos/test_chaos_nats_cluster.py`.",
        "",
        "| fault | load during it | sent | answered correctly | explicit error | lost | "
        "hung | first OK after the fault | first OK after the heal | recovered | "
        "errors by kind |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "—"
        load = f"{r['load']}; {r['baseline_rps']:g} req/s before"
        out.append(
            f"| **{r['fault']}**: {r['what']} | {load} | {r['sent']} | {r['correct']} | "
            f"{r['explicit_error']} | {r['lost']} | {r['hung']} | "
            f"{_fmt_s(r.get('first_ok_after_fault_s'))} | {_fmt_s(r['first_ok_s'])} | "
            f"{_fmt_s(r['recovered_s'])} | {kinds} |"
        )
    lost = sum(r["lost"] for r in rows)
    hung = sum(r["hung"] for r in rows)
    out += [
        "",
        f"Total: {sum(r['sent'] for r in rows)} requests, **{lost} lost, {hung} hung**.",
        "",
        "* A node that leads nothing on the data path costs only what was in flight "
        "through it: services connected to it reconnect to another node within half a "
        "second (their URL list names all three) and re-subscribe; the requests it held "
        "end `DEADLINE_EXCEEDED`, and a closed-loop client waiting on one sends its next "
        "request only then, hence a first OK of up to one deadline in some runs.",
        "* When the work queue's leader dies, publishing micro-batches stops until the "
        "two nodes left elect a new leader: nats-server waits 4-9 s (randomized) for a "
        "lost raft leader. Meanwhile requests end `DEADLINE_EXCEEDED` at their "
        "deadline, then the queue, with every un-acked micro-batch replicated, goes on.",
        "* The catalog keeps following its buckets: a watcher whose consumer lived on the "
        "dead node is replaced within seconds by the catalog's own probe "
        "(`libs/common/tests/test_common_cluster.py`), not after nats-py's 10-20 s.",
        "",
    ]
    return out


def _fmt_s(v: float | None) -> str:
    return "not recovered" if v is None else f"{v:.2f} s"


def _fault_rows(rows: list[dict]) -> list[str]:
    """The matrix's table: its head, one line per fault, crashes, the total."""
    out = [
        "| fault | load during it | sent | answered correctly | explicit error | lost | "
        "hung | in flight at the fault | first OK | recovered | errors by kind |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "—"
        load = f"{r['load']}; {r['baseline_rps']:g} req/s before"
        caught = r.get("in_flight", 0)
        answered = r.get("in_flight_answered_s")
        in_flight = f"{caught}, last answered {answered:.2f} s after" if answered else "—"
        out.append(
            f"| **{r['fault']}**: {r['what']} | {load} | {r['sent']} | {r['correct']} | "
            f"{r['explicit_error']} | {r['lost']} | {r['hung']} | {in_flight} | "
            f"{_fmt_s(r['first_ok_s'])} | {_fmt_s(r['recovered_s'])} | {kinds} |"
        )
    crashed = [(r["fault"], svc) for r in rows for svc in r.get("start_crashes", [])]
    if crashed:
        out += [
            "",
            "**Crashes while restarting** (the harness started the service again; the "
            "service log holds the native stack): "
            + ", ".join(f"{svc} during {fault}" for fault, svc in crashed)
            + ".",
        ]
    lost = sum(r["lost"] for r in rows)
    hung = sum(r["hung"] for r in rows)
    out += [
        "",
        f"Total: {sum(r['sent'] for r in rows)} requests, **{lost} lost, {hung} hung**.",
        "",
    ]
    return out


def _render_edge(rows: list[dict]) -> list[str]:
    """The "Through the gRPC edge" section."""
    return [
        "## Through the gRPC edge",
        "",
        "The same stack with `inferbus-edge` in front of its two gateways, every client "
        "calling the edge's one address (so a client cannot fail over to the other "
        "gateway itself); load, retries and columns as above. The edge answers "
        "`UNAVAILABLE` a call no gateway has claimed for 1 s (`INFERBUS_EDGE_ORPHAN_AFTER`; "
        "a gateway claims every 250 ms the calls it has held longer than that) and every "
        "call waiting when its NATS connection drops; the client retries those with the "
        "same request id. The same faults, shorter, run in `tests/chaos/test_chaos_edge.py`.",
        "",
        *_fault_rows(rows),
    ]


def render(
    faults: list[dict],
    floods: list[dict],
    fuzz: dict | None,
    quick: bool,
    took_s: float,
    generated: str | None = None,
    cluster: list[dict] | None = None,
    edge: list[dict] | None = None,
) -> str:
    """The markdown of ``docs/reliability.md``."""
    generated = generated or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# Reliability report",
        "",
        "Generated by `uv run python bench/reliability.py"
        + (" --quick" if quick else "")
        + f"` on {generated}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}, Python {platform.python_version()}), "
        f"in {took_s / 60:.1f} minutes. Every service, nats-server, redis-server and S3 "
        "(SeaweedFS) run as real processes on this one machine, next to the load "
        "generator. The same code runs, shorter, as `tests/chaos` and `tests/fuzz` in "
        "the default test run.",
        "",
        "## Faults under load",
        "",
        "Stack: registry (on S3), router, batcher, two workers, two gateways (and the "
        "gRPC edge, used by the next section's clients only), Redis holding a cluster "
        "limit. Load: closed loop, each request with a 2 s deadline (the KServe "
        "`timeout` parameter); a client retries only `UNAVAILABLE` (safe to retry per "
        "`docs/architecture.md`), on the other gateway first, within the "
        "original deadline and with the same request id. Each fault is injected after a "
        "steady phase, held, then healed the way a supervisor would (a killed process "
        "is started again on its old ports).",
        "",
        "* **answered correctly**: equal to onnxruntime run in the client process;",
        "* **explicit error**: a status from the platform before the deadline "
        "(by kind in the last column);",
        "* **lost**: neither a correct answer, nor an explicit error, nor counted hung "
        "(includes wrong answers);",
        "* **hung**: nothing by deadline + 1 s;",
        "* **first OK**: from the heal to the first correct answer; **recovered**: from "
        "the heal to the start of the unbroken run of correct answers that lasts to the "
        "end (0: nothing failed after the heal);",
        "* **in flight at the fault**: requests sent and not yet answered when the fault "
        "struck, and when the last of them was answered (seconds after it struck).",
        "",
        *_fault_rows(faults),
    ]
    if edge:
        lines += _render_edge(edge)
    if cluster:
        lines += _render_cluster(cluster)
    lines += [
        "## Overload",
        "",
        f"Model `{SLOW_MODEL}`: two 3x3 convolutions on a {SLOW_SIDE}x{SLOW_SIDE} map, one "
        "request per execution, so the two workers bound capacity (as engines do on a "
        "GPU), at a rate the load generator can offer five times over on the same cores. "
        "Capacity: a closed loop of 16 clients for 3 s. Then an open loop (requests "
        "start on schedule, whatever happened to earlier ones) at 2x and 5x that rate, "
        "2 s deadline. The model's work queue holds 32 micro-batches "
        "(`INFERBUS_BATCHER_STREAM_MAX_MSGS_PER_SUBJECT`); past that the batcher "
        "refuses with `RESOURCE_EXHAUSTED` reason `work-queue-full`. Memory: the largest "
        "RSS growth of any service during the flood (`/proc/<pid>/status`). Recovery: "
        "from the end of the flood until a 0.5 s closed-loop probe is all correct at "
        "≥ 70 % of capacity. Latencies are seen by the client, which runs on the same "
        "cores as the stack: when the offered rate saturates the machine (achieved < "
        "offered), they include the client's own queueing.",
        "",
        "| offered | capacity | sent | OK | refused (429) | deadline | lost | hung | "
        "OK p50 / p99 | refusal p50 / p99 | refusals without reason | max RSS growth | "
        "recovery |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in floods:
        st = f["statuses"]
        growth = max(f["rss_growth_mib"].values(), default=0.0)
        worst = max(f["rss_growth_mib"], key=f["rss_growth_mib"].get, default="")
        lines.append(
            f"| {f['factor']:g}x = {f['offered_rps']:g} req/s for {f['seconds']:g} s "
            f"(achieved {f['achieved_rps']:g}) | {f['capacity_rps']:g} req/s | {f['sent']} | "
            f"{st.get('OK', 0)} | {st.get('RESOURCE_EXHAUSTED', 0)} | "
            f"{st.get('DEADLINE_EXCEEDED', 0)} | {f['lost']} | {f['hung']} | "
            f"{f['ok_p50_ms']:g} / {f['ok_p99_ms']:g} ms | "
            f"{f['reject_p50_ms']:g} / {f['reject_p99_ms']:g} ms | "
            f"{f['refusals_without_reason']} | {growth:g} MiB ({worst}) | "
            f"{_fmt_s(f['recovery_s'])} |"
        )
    lines += ["", "## Hostile input", ""]
    if fuzz is None:
        lines.append("Not run this time (`--skip-fuzz`).")
    else:
        lines += [
            f"`tests/fuzz` with `INFERBUS_FUZZ_EXAMPLES={fuzz['examples_per_test']}` "
            f"(hypothesis examples per test), {fuzz['seconds']:g} s; pytest: "
            f"`{fuzz['pytest']}`. Generators: `inferbus_testing.hostile`.",
            "",
            "| target | examples | answers |",
            "|---|---:|---|",
        ]
        for kind, counts in sorted(fuzz["counts"].items()):
            total = sum(v for k, v in counts.items() if k != "refused-by-stream")
            answers = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
            lines.append(f"| {kind} | {total} | {answers} |")
        if fuzz["failures"]:
            lines += ["", "Failures:", ""] + [f"* `{f}`" for f in fuzz["failures"]]
        lines += [
            "",
            "gRPC requests are sent as raw bytes (valid requests with hostile fields, "
            "non-UTF-8 names spliced into the wire format, truncated and corrupted "
            "protobuf, random bytes); REST requests include invalid and 200 000-deep "
            "JSON, lying binary header lengths and CR/LF in ids; NATS messages are random "
            "bodies and headers on the route, infer, batch-stream, idle, registry-event, "
            "audit and reply subjects. Acceptable: a client error (gRPC "
            "INVALID_ARGUMENT, NOT_FOUND ...; HTTP 4xx) or a correct answer; after each "
            "run every process is alive and a good request is answered. 100 MB bodies "
            "(gRPC, REST with and without Content-Length) are refused before the model.",
        ]
    lines += [
        "",
        "## Reading the table",
        "",
        "* A killed router or batcher (one instance each here) loses the requests it "
        "held in memory: they end `DEADLINE_EXCEEDED` at their deadline, nothing is "
        "lost. Requests sent while it is down are answered `UNAVAILABLE` at once "
        "(nats-server's *no responders* to the gateway, or to the router, which "
        "forwards with its own reply subject), which the client retries. Run two of "
        "each and only the in-memory requests of the dead one are affected.",
        "* A nats-server restart loses what was in flight in the server: those "
        "requests end `DEADLINE_EXCEEDED`; the work-queue stream (memory storage) and "
        "the workers' consumers are re-created, the catalogs re-watched, by the "
        "services themselves. *first OK* is about one deadline after the heal because "
        "each closed-loop client is still waiting on its lost request.",
        "* A killed worker's micro-batches are redelivered to the other after their "
        "first ack wait (0.5 s; the worker keeps the batches it works on alive, so "
        "only a dead or frozen worker's come back): *kill-busy-worker* kills one while "
        "it holds batches, whose requests are answered correctly about half a second "
        "after the kill instead of at their deadline. A frozen worker's batches are "
        "redelivered the same way, and its late replies are dropped as duplicates by "
        "the gateway.",
        "* The matrix runs with the gateways' circuit breakers off "
        "(`INFERBUS_GATEWAY_BREAKER_ENABLED=false`): a breaker would turn the burst of "
        "errors of a fault into `breaker_open_s` of refusals after it, which measures "
        "the breaker, not the recovery (it has its own tests).",
        "* Under 5x overload the admitted rate falls below capacity: on two shared "
        "cores, answering thousands of refusals takes CPU from the workers.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run everything asked for, write the report, return non-zero if a row failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized runs")
    parser.add_argument("--skip-fuzz", action="store_true", help="no hostile-input run")
    parser.add_argument(
        "--skip-cluster", action="store_true", help="no three-node NATS cluster faults"
    )
    parser.add_argument("--fuzz-examples", type=int, default=None, help="examples per test")
    parser.add_argument("--out", type=Path, default=DOC, help="markdown to write")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="only re-render a results file"
    )
    args = parser.parse_args(argv)
    if args.from_json is not None:
        raw = json.loads(args.from_json.read_text())
        took = raw.get("took_s", 0.0)
        args.out.write_text(
            render(
                raw["faults"],
                raw["overload"],
                raw["fuzz"],
                raw["quick"],
                took,
                raw.get("generated"),
                raw.get("cluster"),
                raw.get("edge"),
            )
        )
        print(f"wrote {args.out}")
        return 0
    t0 = time.monotonic()
    faults, edge, floods = run_matrix_and_overload(args.quick, 3.0 if args.quick else 10.0)
    cluster = [] if args.skip_cluster else run_cluster_faults(args.quick)
    fuzz = None
    if not args.skip_fuzz:
        fuzz = run_fuzz(args.fuzz_examples or (300 if args.quick else 10_000))
    took = time.monotonic() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    raw = {
        "faults": faults,
        "edge": edge,
        "overload": floods,
        "cluster": cluster,
        "fuzz": fuzz,
        "quick": args.quick,
        "took_s": took,
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (RESULTS / f"reliability-{stamp}.json").write_text(json.dumps(raw, indent=2))
    args.out.write_text(render(faults, floods, fuzz, args.quick, took, cluster=cluster, edge=edge))
    print(f"wrote {args.out}")
    bad = [
        r["fault"]
        for r in [*faults, *edge, *cluster]
        if r["lost"] or r["hung"] or r["recovered_s"] is None
    ]
    bad += [f"overload {f['factor']:g}x" for f in floods if f["lost"] or f["hung"]]
    if fuzz is not None and fuzz["exit_code"] != 0:
        bad.append("fuzz")
    if bad:
        print(f"FAILED: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
