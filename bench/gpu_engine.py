"""GPU engine A/B: the worker's engine against a bare ``session.run``, on one GPU.

Arms (each a real `build_engine` from a config variant of the model):

* ``plain``: CUDA provider, numpy in and out (``io_binding: false``);
* ``iobinding``: CUDA provider through IO binding (the default);
* ``graphs``: IO binding and CUDA graphs (``enable_cuda_graph: true``);
* ``group2``: IO binding, ``instance_group.count`` 2 (two sessions).

For each arm: p50/p99 latency of back-to-back ``engine.run`` at concurrency 1
(batch 1), throughput with ``--threads`` threads at ``--batch`` rows, and the
GPU's busy share during the throughput window (NVML, sampled every 50 ms when
``pynvml`` works). The ``raw`` arm is a bare ``InferenceSession.run`` with
numpy (what the engine's overhead is measured against). The ``tf32`` lines
give the largest difference from the CPU with ``use_tf32`` on and off.

Needs onnxruntime-gpu and a GPU; prints a markdown table and appends one
JSON line per arm to ``--out``. Not run in CI.

Usage::

    uv run python bench/gpu_engine.py --model-dir bench/models/heavy --seconds 5
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inferbus_common.datatypes import V2_TO_NUMPY
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines import Engine, build_engine, warmup_batch_sizes

ARMS: dict[str, dict[str, Any]] = {
    "plain": {"cuda": {"io_binding": False}},
    "iobinding": {"cuda": {"io_binding": True}},
    "graphs": {"cuda": {"io_binding": True, "enable_cuda_graph": True}},
    "group2": {"cuda": {"io_binding": True}, "instance_group": {"count": 2}},
}


def _variant(config: ModelConfig, arm: dict[str, Any]) -> ModelConfig:
    doc = config.model_dump()
    doc["engine"] = {**doc["engine"], "providers": ["cuda"], "cuda": arm["cuda"]}
    if "instance_group" in arm:
        doc["instance_group"] = arm["instance_group"]
        doc["instance_count"] = 1
    return ModelConfig.model_validate(doc)


def _feed(config: ModelConfig, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feed = {}
    for spec in config.inputs:
        shape = [batch if d == -1 and i == 0 else max(d, 1) for i, d in enumerate(spec.shape)]
        feed[spec.name] = rng.normal(size=shape).astype(V2_TO_NUMPY[spec.datatype])
    return feed


class GpuBusy:
    """GPU busy share between `start` and `stop` (NVML utilisation samples)."""

    def __init__(self) -> None:
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no pynvml, no driver: no busy figure
            self._nvml = None

    def start(self) -> None:
        """Start sampling."""
        if self._nvml is None:
            return
        self._samples.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            self._samples.append(rates.gpu / 100.0)

    def stop(self) -> float | None:
        """Stop sampling; the mean busy share (None without NVML)."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        return float(np.mean(self._samples)) if self._samples else None


def _latency(run: Any, seconds: float) -> dict[str, float]:
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        run()
        lat.append(time.perf_counter() - t)
    arr = np.array(lat) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99))}


def _throughput(run: Any, threads: int, rows: int, seconds: float, busy: GpuBusy) -> dict:
    done = [0] * threads
    end = time.perf_counter() + seconds

    def loop(i: int) -> None:
        while time.perf_counter() < end:
            run()
            done[i] += 1

    busy.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(loop, range(threads)))
    elapsed = time.perf_counter() - t0
    share = busy.stop()
    return {"rows_per_s": sum(done) * rows / elapsed, "gpu_busy": share}


def measure_engine(eng: Engine, config: ModelConfig, args: argparse.Namespace, busy: GpuBusy):
    """Latency at c=1 (batch 1) and throughput of one loaded engine."""
    outputs = [s.name for s in config.outputs]
    one, many = _feed(config, 1), _feed(config, args.batch)
    out = _latency(lambda: eng.run(one, outputs), args.seconds)
    out |= _throughput(lambda: eng.run(many, outputs), args.threads, args.batch, args.seconds, busy)
    return out


def main() -> None:
    """Run every arm and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_engine.jsonl"))
    args = parser.parse_args()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise SystemExit("this onnxruntime has no CUDA execution provider")
    config = ModelConfig.model_validate_json((args.model_dir / "config.json").read_text())
    busy = GpuBusy()
    rows: list[dict[str, Any]] = []

    raw = ort.InferenceSession(
        str(args.model_dir / config.file), providers=["CUDAExecutionProvider"]
    )
    one, many = _feed(config, 1), _feed(config, args.batch)
    raw_row = {"arm": "raw"} | _latency(lambda: raw.run(None, one), args.seconds)
    raw_row |= _throughput(
        lambda: raw.run(None, many), args.threads, args.batch, args.seconds, busy
    )
    rows.append(raw_row)

    for name, arm in ARMS.items():
        variant = _variant(config, arm)
        eng = build_engine(variant, args.model_dir, trt_cache_dir=Path("/tmp/ib-trt"))
        eng.load()
        eng.warmup(warmup_batch_sizes(variant))
        try:
            rows.append(
                {"arm": name, "engine": eng.description} | measure_engine(eng, variant, args, busy)
            )
        finally:
            eng.close()

    cpu = ort.InferenceSession(
        str(args.model_dir / config.file), providers=["CPUExecutionProvider"]
    )
    want = cpu.run(None, many)[0]
    for tf32 in (True, False):
        variant = _variant(config, {"cuda": {"use_tf32": tf32}})
        eng = build_engine(variant, args.model_dir, trt_cache_dir=Path("/tmp/ib-trt"))
        eng.load()
        got = eng.run(many, [config.outputs[0].name])[config.outputs[0].name]
        eng.close()
        rows.append({"arm": f"tf32={tf32}", "max_abs_diff_vs_cpu": float(np.abs(got - want).max())})

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print("| arm | p50 c=1 (ms) | p99 c=1 (ms) | rows/s | GPU busy |")
    print("|---|---|---|---|---|")
    for row in rows:
        if "p50_ms" in row:
            share = row["gpu_busy"]
            print(
                f"| {row['arm']} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | "
                f"{row['rows_per_s']:,.0f} | {'-' if share is None else f'{share:.0%}'} |"
            )
    for row in rows:
        if "max_abs_diff_vs_cpu" in row:
            print(f"{row['arm']}: max |GPU - CPU| = {row['max_abs_diff_vs_cpu']:.2e}")


if __name__ == "__main__":
    main()
