"""The limit: the same ONNX model run by onnxruntime in-process, no server at all.

For each thread setting (``--threads``, ``0`` = onnxruntime's default, one per
core) it measures batch-1 latency (back-to-back ``session.run`` calls) and
batched throughput at ``--batch`` rows per call, for ``--seconds`` each after
a short warm-up, and appends one JSON line per setting to ``--out``.

Usage::

    uv run python bench/raw_ort.py --model-dir bench/models/heavy --threads 1 0
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from record import RESULTS_DIR, append_result, machine_info


def _session(model: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])


def _timed_runs(
    sess: ort.InferenceSession, feed: dict[str, np.ndarray], seconds: float
) -> np.ndarray:
    """Latencies (s) of back-to-back runs for `seconds`, after a few warm-up runs."""
    for _ in range(5):
        sess.run(None, feed)
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        sess.run(None, feed)
        done = time.perf_counter()
        lat.append(done - t)
        if done >= end:
            break
    return np.array(lat)


def measure(model_dir: Path, threads: int, batch: int, seconds: float) -> dict[str, Any]:
    """Batch-1 latency and batch-`batch` throughput of one session.

    Args:
        model_dir: folder with ``model.onnx`` and ``config.json``.
        threads: intra-op threads (0: one per core).
        batch: rows per call for the throughput figure.
        seconds: measuring time of each figure.

    Returns:
        The result fields of one JSON line.
    """
    config = json.loads((model_dir / "config.json").read_text())
    spec = config["inputs"][0]
    width = int(spec["shape"][-1])
    sess = _session(model_dir / config.get("file", "model.onnx"), threads)
    rng = np.random.default_rng(1)
    one = {spec["name"]: rng.standard_normal((1, width)).astype(np.float32)}
    many = {spec["name"]: rng.standard_normal((batch, width)).astype(np.float32)}
    lat1 = _timed_runs(sess, one, seconds)
    latb = _timed_runs(sess, many, seconds)
    ms = 1000.0
    return {
        "threads": threads,
        "threads_effective": threads or len(os.sched_getaffinity(0)),
        "batch1": {
            "runs": int(lat1.size),
            "throughput_rps": round(lat1.size / float(lat1.sum()), 1),
            "latency_ms": {
                "p50": round(float(np.percentile(lat1, 50)) * ms, 4),
                "p90": round(float(np.percentile(lat1, 90)) * ms, 4),
                "p99": round(float(np.percentile(lat1, 99)) * ms, 4),
            },
        },
        "batched": {
            "batch": batch,
            "runs": int(latb.size),
            "throughput_rows_s": round(latb.size * batch / float(latb.sum()), 1),
            "latency_ms": {
                "p50": round(float(np.percentile(latb, 50)) * ms, 4),
                "p99": round(float(np.percentile(latb, 99)) * ms, 4),
            },
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: measure every thread setting, print and append JSON lines."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--model", default="", help="label (default: config.json name)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "raw_ort.jsonl")
    args = p.parse_args(argv)
    name = args.model or json.loads((args.model_dir / "config.json").read_text())["name"]
    for threads in args.threads:
        record = {
            "kind": "raw_ort",
            "target": "raw-ort",
            "command": shlex.join([sys.executable, sys.argv[0], *argv]),
            "model": name,
            **measure(args.model_dir, threads, args.batch, args.seconds),
            "machine": machine_info(),
        }
        append_result(args.out, record)
        print(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
