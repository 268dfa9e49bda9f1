"""Triton's perf_analyzer, unmodified, against a running inferbus stack, gRPC and HTTP.

perf_analyzer reads the model's config (model configuration extension) and
its server-side figures from the statistics extension; this script only runs
it at each concurrency and puts its CSV figures in one table::

    uv run inferbus up --home /tmp/pa-stack --free-ports --no-llm -d
    uv run python examples/fraud/make_model.py --out /tmp/fraud
    uv run inferbus models push /tmp/fraud --name fraud --version 1 --home /tmp/pa-stack
    bash scripts/install-perf-analyzer.sh
    uv run python bench/perf_analyzer.py --home /tmp/pa-stack --model fraud \\
        --concurrency 1 2 4 8 16
    uv run inferbus down --home /tmp/pa-stack

A model pushed with a semantic version (``--version 1.0.0``) is measured the
same way; to pin a version pass ``--pa-args '-x 1.0.0'`` or its number
(``-x 1``, see ``inferbus models list``; docs/architecture.md, "Version
numbers for Triton's tools").

The binary comes from `scripts/install-perf-analyzer.sh` (``--binary`` or
``$INFERBUS_PERF_ANALYZER_DIR``/``.venvs/perf_analyzer`` by default). Server
figures are as of the workers' last heartbeats (docs/architecture.md,
"Triton's protocol extensions"): keep the measurement window at a few
seconds (the default 5 s).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_binary() -> Path:
    """Where `scripts/install-perf-analyzer.sh` puts the wrapper."""
    base = os.environ.get("INFERBUS_PERF_ANALYZER_DIR") or str(REPO / ".venvs" / "perf_analyzer")
    return Path(base) / "perf_analyzer"


def stack_urls(home: Path) -> tuple[str, str]:
    """(gRPC ``host:port``, HTTP ``host:port``) of the gateway of the stack at `home`."""
    state = json.loads((home / "state.json").read_text())
    endpoints = state["endpoints"]
    http = endpoints["gateway_http"].removeprefix("http://").rstrip("/")
    return endpoints["gateway_grpc"], http


@dataclass(slots=True)
class Row:
    """perf_analyzer's figures for one protocol and concurrency (latencies in µs)."""

    protocol: str
    concurrency: int
    throughput: float
    p50_us: int
    p90_us: int
    p99_us: int
    server_queue_us: int
    server_compute_us: int


def _int(record: dict[str, str], key: str) -> int:
    return int(float(record.get(key) or 0))


def run_one(
    binary: Path,
    protocol: str,
    url: str,
    model: str,
    concurrency: int,
    extra: Sequence[str] = (),
    *,
    timeout_s: float = 600.0,
) -> tuple[Row, list[str], str]:
    """Run perf_analyzer once at one concurrency.

    Returns:
        Its figures, the command line, and its console output.

    Raises:
        RuntimeError: it exited non-zero (its output is in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "pa.csv"
        argv = [
            str(binary),
            "-m",
            model,
            "-u",
            url,
            "-i",
            protocol,
            "--concurrency-range",
            str(concurrency),
            "-f",
            str(csv_path),
            *extra,
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0 or not csv_path.exists():
            raise RuntimeError(
                f"perf_analyzer exited {proc.returncode}: {shlex.join(argv)}\n{output[-3000:]}"
            )
        with csv_path.open() as f:
            (record,) = list(csv.DictReader(f))
    compute = sum(
        _int(record, k)
        for k in ("Server Compute Input", "Server Compute Infer", "Server Compute Output")
    )
    row = Row(
        protocol=protocol,
        concurrency=int(record["Concurrency"]),
        throughput=float(record["Inferences/Second"]),
        p50_us=_int(record, "p50 latency"),
        p90_us=_int(record, "p90 latency"),
        p99_us=_int(record, "p99 latency"),
        server_queue_us=_int(record, "Server Queue"),
        server_compute_us=compute,
    )
    return row, argv, output


def table(rows: Sequence[Row]) -> str:
    """The figures as a Markdown table."""
    lines = [
        "| protocol | concurrency | infer/s | p50 ms | p90 ms | p99 ms | server queue ms "
        "| server compute ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.protocol} | {r.concurrency} | {r.throughput:.1f} | {r.p50_us / 1000:.2f} "
            f"| {r.p90_us / 1000:.2f} | {r.p99_us / 1000:.2f} | {r.server_queue_us / 1000:.2f} "
            f"| {r.server_compute_us / 1000:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run perf_analyzer over gRPC and HTTP at each concurrency; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, help="home of an `inferbus up` stack (state.json)")
    parser.add_argument("--grpc-url", help="gateway gRPC HOST:PORT (instead of --home)")
    parser.add_argument("--http-url", help="gateway HTTP HOST:PORT (instead of --home)")
    parser.add_argument("--model", default="fraud")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--protocols", nargs="+", default=["grpc", "http"])
    parser.add_argument("--binary", type=Path, default=default_binary())
    parser.add_argument(
        "--pa-args",
        default="--stability-percentage 30",
        help="more perf_analyzer arguments as one string (default: %(default)r; its own "
        "default of 10%% rarely settles on a shared 2-core machine), e.g. '-p 3000 -b 4'",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON lines here")
    args = parser.parse_args(argv)
    if not args.binary.exists():
        print(f"no perf_analyzer at {args.binary}: run scripts/install-perf-analyzer.sh")
        return 2
    grpc_url, http_url = args.grpc_url, args.http_url
    if args.home is not None:
        grpc_url, http_url = stack_urls(args.home)
    urls = {"grpc": grpc_url, "http": http_url}
    missing = [p for p in args.protocols if not urls.get(p)]
    if missing:
        parser.error(f"no URL for {missing}: give --home or --grpc-url/--http-url")
    extra = shlex.split(args.pa_args)
    rows = []
    for protocol in args.protocols:
        for c in args.concurrency:
            row, cmd, _ = run_one(args.binary, protocol, urls[protocol], args.model, c, extra)
            print(f"$ {shlex.join(cmd)}", file=sys.stderr)
            print(
                f"  {protocol} c={c}: {row.throughput:.1f} infer/s, p50 {row.p50_us} us, "
                f"p99 {row.p99_us} us",
                file=sys.stderr,
            )
            rows.append(row)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps({"model": args.model, **asdict(row)}) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
