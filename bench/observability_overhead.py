"""What tracing, access logs and metrics cost: throughput with them on and off.

Runs the inferbus stack (``bench/stack.py``) once per configuration, serving
the example fraud model, and drives it with ``bench/loadgen.py`` (gRPC, closed
loop). Configurations, in this order:

* ``off``: tracing off, access log off (metrics cannot be turned off);
* ``access-log``: the gateway's access log on (its default), tracing off;
* ``default``: access log on, tracing on at the default sample ratio (0.01),
  spans exported over OTLP/gRPC to a collector run by this script;
* ``all-traced``: the same with every request traced (ratio 1.0), the worst case.

The metrics' share is measured apart, in-process: the per-request metric
operations of the gateway, router, batcher and worker, timed in a loop.

Usage::

    uv run python bench/observability_overhead.py [--duration 6] [--concurrency 32]

Prints one line per configuration and one JSON object per result, appended to
``bench/results/overhead.jsonl``; the figures in ``docs/benchmarks.md``
("Observability overhead") come from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from cpu_window import proc_cpu_s
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from record import REPO, RESULTS_DIR, append_result, machine_info
from stack import BenchStack

TRACED = ("GATEWAY", "ROUTER", "BATCHER", "WORKER")


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver that only counts spans."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        """Count the spans of one export call."""
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def configurations(endpoint: str) -> dict[str, dict[str, str]]:
    """Environment of every service, per configuration."""
    off = {"INFERBUS_GATEWAY_ACCESS_LOG": "false"}
    traced = {"INFERBUS_GATEWAY_ACCESS_LOG": "true"}
    for svc in TRACED:
        traced |= {
            f"INFERBUS_{svc}_TRACING_ENABLED": "true",
            f"INFERBUS_{svc}_TRACING_OTLP_ENDPOINT": endpoint,
        }
    return {
        "off": off,
        "access-log": {"INFERBUS_GATEWAY_ACCESS_LOG": "true"},
        "default": traced,
        "all-traced": traced | {f"INFERBUS_{svc}_TRACING_SAMPLE_RATIO": "1.0" for svc in TRACED},
    }


def make_model(work: Path) -> Path:
    """The example fraud model, written by its own script."""
    out = work / "fraud"
    subprocess.run(
        [sys.executable, str(REPO / "examples/fraud/make_model.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


def loadgen(url: str, label: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One closed-loop run of ``bench/loadgen.py``; its JSON record."""
    argv = [
        sys.executable,
        "bench/loadgen.py",
        "--url",
        url,
        "--model",
        "fraud",
        "--concurrency",
        str(args.concurrency),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--label",
        f"overhead/{label}",
        "--out",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO)
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return line


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes used so far (from /proc)."""
    return sum(proc_cpu_s(pid) for pid in pids)


def answered(stack: BenchStack) -> float:
    """Requests the gateway has answered so far (any status)."""
    return sum(
        v
        for k, v in stack.metrics(stack.gateway).items()
        if k.startswith("inferbus_gateway_requests_total{")
    )


def metrics_cost_us() -> dict[str, float]:
    """Microseconds of the per-request metric operations, per service (in-process)."""
    from inferbus_batcher.metrics import QueueMetrics
    from inferbus_gateway.observation.access import IN_FLIGHT, _observe_stages
    from inferbus_gateway.pipeline.steps import LATENCY, REQUESTS
    from inferbus_router.router import ROUTE_SECONDS, ROUTED
    from inferbus_worker import metrics as wm

    timings = {"queue": 0.4, "compute": 1.1, "gateway": 0.3, "total": 2.2}
    qm = QueueMetrics("fraud", "1")
    labels = {"model": "fraud", "version": "1"}

    def gateway() -> None:
        IN_FLIGHT.inc()
        IN_FLIGHT.dec()
        REQUESTS.labels("fraud", "1", "grpc", "OK").inc()
        LATENCY.labels("fraud", "grpc").observe(0.0022)
        _observe_stages("fraud", timings)

    def router() -> None:
        ROUTED.labels("fraud", "1", "OK").inc()
        ROUTE_SECONDS.observe(0.00005)

    def batcher() -> None:
        qm.queue_time.observe(0.0004)
        qm.depth.set(3)

    def worker() -> None:
        wm.REPLIES.labels(**labels, status="OK").inc()
        wm.QUEUE_SECONDS.labels(**labels).observe(0.0004)

    return {
        name: round(_cpu_us(fn), 2)
        for name, fn in (
            ("gateway", gateway),
            ("router", router),
            ("batcher", batcher),
            ("worker", worker),
        )
    }


def _cpu_us(fn: Callable[[], object], n: int = 20_000) -> float:
    """CPU microseconds per call of `fn` (best of 5; other processes do not count)."""
    return min(timeit.repeat(fn, number=n, repeat=5, timer=time.process_time)) / n * 1e6


def tracing_and_log_cost_us() -> dict[str, float]:
    """CPU microseconds per request of tracing and of the access log (in-process).

    ``*_unsampled``: what every request pays with tracing on and not sampled (the
    gateway's sampling decision, the flag check at each later hop). ``sampled``:
    building and ending the five spans of one traced request in one process
    (export, done by a background thread, comes on top). ``access_log``: one
    JSON line written to a file.
    """
    from inferbus_common import tracing
    from inferbus_common.logs import JsonFormatter
    from inferbus_common.settings import ServiceSettings
    from inferbus_gateway.observation.access import RequestScope, access_log

    out: dict[str, float] = {}
    unsampled_tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"

    def gateway_scope() -> None:
        with RequestScope("grpc", "fraud", "", False):
            pass

    out["gateway_scope_tracing_off"] = _cpu_us(gateway_scope)
    tracing.setup_tracing(
        "bench",
        ServiceSettings(tracing_enabled=True, tracing_sample_ratio=0.0, tracing_exporter="none"),
    )
    try:
        out["gateway_scope_unsampled"] = _cpu_us(gateway_scope)
        out["later_hop_unsampled"] = _cpu_us(
            lambda: tracing.start_child_span("x", unsampled_tp), n=200_000
        )
    finally:
        tracing.shutdown_tracing()
    tracing.setup_tracing(
        "bench",
        ServiceSettings(tracing_enabled=True, tracing_sample_ratio=1.0, tracing_exporter="none"),
    )

    def traced_request() -> None:
        gw = tracing.start_server_span("gw", "", {"inferbus.model": "fraud"})
        assert gw is not None
        rt = tracing.start_child_span("router", tracing.traceparent_of(gw))
        assert rt is not None
        q = tracing.start_child_span("queue", tracing.traceparent_of(rt))
        assert q is not None
        tp = tracing.traceparent_of(q)
        link = tracing.link_to(tp)
        batch = tracing.start_child_span("batch", tp, links=[link] if link else [])
        req = tracing.start_child_span("request", tp)
        for span in (req, batch, q, rt, gw):
            tracing.end_span(span)

    try:
        out["sampled"] = _cpu_us(traced_request, n=5_000)
    finally:
        tracing.shutdown_tracing()

    with tempfile.NamedTemporaryFile("w", suffix=".log") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(JsonFormatter("gateway"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
        try:
            with_log = _cpu_us(lambda: RequestScope("grpc", "fraud", "", True).finish(None))
            without = _cpu_us(lambda: RequestScope("grpc", "fraud", "", False).finish(None))
        finally:
            access_log.removeHandler(handler)
            access_log.propagate = True
    out["access_log"] = with_log - without
    return {k: round(v, 2) for k, v in out.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every configuration; print and append the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "overhead.jsonl")
    args = p.parse_args(argv)

    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    results: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ib-overhead-") as tmp:
            work = Path(tmp)
            model = make_model(work)
            for name, env in configurations(f"http://127.0.0.1:{port}").items():
                spans_before = collector.spans
                with BenchStack(work / name, workers=args.workers, env=env) as stack:
                    stack.push(model, "fraud")
                    stack.wait_model_ready("fraud")
                    pids = list(stack.pids().values())
                    cpu0, n0 = cpu_seconds(pids), answered(stack)
                    line = loadgen(stack.grpc_url, name, args, args.out)
                    cpu1, n1 = cpu_seconds(pids), answered(stack)
                    time.sleep(0.5)  # let the last spans reach the collector
                line["spans_exported"] = collector.spans - spans_before
                # The platform's CPU per answered request: robust to a busy machine,
                # unlike throughput (nats-server and the load generator not included).
                line["cpu_us_per_request"] = round((cpu1 - cpu0) / max(1.0, n1 - n0) * 1e6, 1)
                results[name] = line
                lat = line["latency_ms"]
                print(
                    f"{name:11s} {line['throughput_rps']:8.1f} req/s  p50 {lat['p50']} ms"
                    f"  p99 {lat['p99']} ms  cpu {line['cpu_us_per_request']} us/req"
                    f"  errors {line['errors']}  spans {line['spans_exported']}",
                    file=sys.stderr,
                )
    finally:
        server.stop(grace=None)

    base = results["off"]["throughput_rps"]
    summary = {
        "kind": "observability_overhead",
        "command": " ".join([sys.executable, *sys.argv]),
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "throughput_rps": {k: v["throughput_rps"] for k, v in results.items()},
        "ratio_to_off": {k: round(v["throughput_rps"] / base, 3) for k, v in results.items()},
        "p99_ms": {k: v["latency_ms"]["p99"] for k, v in results.items()},
        "cpu_us_per_request": {k: v["cpu_us_per_request"] for k, v in results.items()},
        "cpu_ratio_to_off": {
            k: round(v["cpu_us_per_request"] / results["off"]["cpu_us_per_request"], 3)
            for k, v in results.items()
        },
        "spans_exported": {k: v["spans_exported"] for k, v in results.items()},
        "metrics_us_per_request": metrics_cost_us(),
        "tracing_and_log_us_per_request": tracing_and_log_cost_us(),
        "machine": machine_info(),
    }
    append_result(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
