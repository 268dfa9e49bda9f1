"""The same MLP served by each tensor engine: ONNX Runtime (CPU EP), TorchScript, torch.export,
and (``--stack``, where ``.venvs/openvino`` exists) ONNX Runtime's OpenVINO EP.

Engine-only runs with the PyTorch environment's interpreter, which holds
torch, ONNX Runtime and the worker (``scripts/bootstrap-torch.sh``); the stack
run with the workspace's, starting its worker with ``.venvs/torch``::

    .venvs/torch/bin/python bench/engines.py        # engine-only, fraud and heavy (~40 s)
    uv run python bench/engines.py --stack          # through the stack, fraud (~70 s)

The models are the example fraud MLP (64→32→2) and the benchmark's heavy
MLP (256→5x1536→16), each built three times with the same weights:
``examples/fraud/make_model.py`` / ``bench/models/make_heavy.py`` (ONNX) and
``examples/torch-mlp/build.py`` (TorchScript ``model.pt``, torch.export
``model.pt2``).

Engine-only: the worker's own engines (`inferbus_worker.engines.build_engine`:
what a worker loads for the version, one intra-op thread, the configs'
default), ``Engine.run`` called in this process on a read-only float32 array
(as the worker passes a request's bytes), p50 and p90 of ``--runs`` calls
after warm-up, at batch 1 and 32, the engines taken in turn in 5 rounds. The
error column is the max abs difference of ``probabilities`` against ONNX
Runtime on the same rows.

``--stack``: a `LocalStack` whose worker runs with ``.venvs/torch`` and
serves the three fraud versions, plus, where ``.venvs/openvino`` exists
(``scripts/bootstrap-openvino.sh``), a worker of that interpreter in pool
``openvino`` serving the ONNX version with ``engine.providers: ["openvino"]``
(row ``openvino-ep``). For each ``--concurrency`` level (default 1 and 64):
c=1 is the p50 latency of sequential one-row gRPC requests, c>1 the requests
per second with that many concurrent one-row requests at a time (the
micro-batcher at work); ``--seconds`` per engine and level, in three rounds
that take the engines in turn (median of the rounds).

Raw results go to ``bench/results/engines-{engine,stack}-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines import build_engine

REPO = Path(__file__).resolve().parents[1]
TORCH_PYTHON = REPO / ".venvs" / "torch" / "bin" / "python"
OPENVINO_PYTHON = REPO / ".venvs" / "openvino" / "bin" / "python"
HEAVY = [256, 1536, 1536, 1536, 1536, 1536, 16]
ENGINES = {"onnxruntime": "model.onnx", "torchscript": "model.pt", "torch.export": "model.pt2"}


def build_versions(root: Path, name: str, sizes: list[int]) -> dict[str, Path]:
    """The three version directories of one MLP: engine name → directory."""
    onnx_dir = root / name / "onnx"
    script = "examples/fraud/make_model.py" if name == "fraud" else "bench/models/make_heavy.py"
    subprocess.run(
        [sys.executable, str(REPO / script), "--out", str(onnx_dir)],
        check=True,
        capture_output=True,
    )
    dirs = {"onnxruntime": onnx_dir}
    for engine, fmt in (("torchscript", "pt"), ("torch.export", "pt2")):
        out = root / name / fmt
        build = [str(TORCH_PYTHON), str(REPO / "examples/torch-mlp/build.py")]
        subprocess.run(
            [*build, "--out", str(out), "--format", fmt, "--sizes", ",".join(map(str, sizes))],
            check=True,
            capture_output=True,
        )
        dirs[engine] = out
    return dirs


def _config(directory: Path, name: str) -> ModelConfig:
    doc = json.loads((directory / "config.json").read_text())
    return ModelConfig.model_validate({**doc, "name": name})


def engine_only(dirs: dict[str, Path], runs: int, rounds: int = 5) -> list[dict[str, Any]]:
    """p50/p90 of ``Engine.run`` per engine and batch size, and the error against ONNX.

    Every engine is loaded first; then `rounds` rounds each time every engine
    in turn (``runs / rounds`` calls per round), so that a noisy neighbour or
    the allocator's state hits all of them alike.
    """
    width = _config(dirs["onnxruntime"], "m").inputs[0].shape[1]
    engines = {}
    for engine_name, directory in dirs.items():
        engine = build_engine(_config(directory, "bench"), directory, trt_cache_dir=directory)
        engine.load()
        engine.warmup([1, 32])
        engines[engine_name] = engine
    rows = []
    for batch in (1, 32):
        x = np.random.default_rng(batch).standard_normal((batch, width)).astype(np.float32)
        feeds = {"input": np.frombuffer(x.tobytes(), np.float32).reshape(batch, width)}
        times: dict[str, list[float]] = {name: [] for name in engines}
        answers = {}
        for name, engine in engines.items():
            for _ in range(max(20, runs // 20)):
                answers[name] = engine.run(feeds, ["probabilities"])["probabilities"]
        for _ in range(rounds):
            for name, engine in engines.items():
                for _ in range(max(1, runs // rounds)):
                    start = time.perf_counter_ns()
                    engine.run(feeds, ["probabilities"])
                    times[name].append((time.perf_counter_ns() - start) / 1000)
        for name, engine in engines.items():
            ordered = sorted(times[name])
            rows.append(
                {
                    "engine": name,
                    "description": engine.description,
                    "batch": batch,
                    "p50_us": round(statistics.median(ordered), 1),
                    "p90_us": round(ordered[int(len(ordered) * 0.9)], 1),
                    "max_abs_diff": float(np.abs(answers[name] - answers["onnxruntime"]).max()),
                }
            )
    for engine in engines.values():
        engine.close()
    return rows


def add_openvino(dirs: dict[str, Path], root: Path) -> None:
    """The ONNX version with ``providers: ["openvino"]`` in pool ``openvino``, as
    engine ``openvino-ep``."""
    out = root / "fraud" / "openvino"
    shutil.copytree(dirs["onnxruntime"], out)
    doc = json.loads((out / "config.json").read_text())
    doc.update(pool="openvino", engine={**doc.get("engine", {}), "providers": ["openvino"]})
    (out / "config.json").write_text(json.dumps(doc))
    dirs["openvino-ep"] = out


def through_stack(
    dirs: dict[str, Path],
    base: Path,
    seconds: float,
    concurrency: list[int],
    rounds: int = 3,
) -> list[dict[str, Any]]:
    """c=1 p50 latency and c>1 throughput (median of `rounds`) over gRPC, per engine."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio

    from inferbus_testing.stack import LocalStack

    rows = []
    with LocalStack(base, workers=0) as stack:
        stack.start_worker("worker", python=str(TORCH_PYTHON)).wait_ready(timeout=60)
        if "openvino-ep" in dirs:
            stack.start_worker(
                "openvino-worker",
                python=str(OPENVINO_PYTHON),
                env={"INFERBUS_WORKER_POOL": "openvino"},
            ).wait_ready(timeout=60)
        names = {}
        for engine_name, directory in dirs.items():
            model = "fraud-" + engine_name.replace(".", "-")
            doc = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps({**doc, "name": model}))
            stack.push(directory, model)
            names[engine_name] = model
        for model in names.values():
            stack.wait_model_ready(model, timeout=90)
        x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)

        def sequential(model: str, window: float) -> list[float]:
            client = grpcclient.InferenceServerClient(stack.grpc_url)
            inp = grpcclient.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            times = []
            try:
                end = time.monotonic() + window
                while time.monotonic() < end:
                    start = time.perf_counter_ns()
                    client.infer(model, [inp])
                    times.append((time.perf_counter_ns() - start) / 1000)
            finally:
                client.close()
            return times

        async def closed_loop(model: str, window: float, c: int) -> float:
            aclient = grpcaio.InferenceServerClient(stack.grpc_url)
            ainp = grpcaio.InferInput("input", [1, 64], "FP32")
            ainp.set_data_from_numpy(x)
            done = 0
            stop = time.monotonic() + window

            async def one() -> None:
                nonlocal done
                while time.monotonic() < stop:
                    await aclient.infer(model, [ainp])
                    done += 1

            try:
                await asyncio.gather(*(one() for _ in range(c)))
            finally:
                await aclient.close()
            return done / window

        for model in names.values():
            sequential(model, 1.0)  # warm-up
        # Rounds of every engine in turn: a noisy neighbour hits all arms alike.
        c1: dict[str, list[float]] = {e: [] for e in names}
        rps: dict[tuple[str, int], list[float]] = {}
        window = seconds / rounds
        for _ in range(rounds):
            for engine_name, model in names.items():
                for c in concurrency:
                    if c == 1:
                        c1[engine_name] += sequential(model, window)
                    else:
                        got = asyncio.run(closed_loop(model, window, c))
                        rps.setdefault((engine_name, c), []).append(got)
        for engine_name in names:
            row: dict[str, Any] = {"engine": engine_name}
            if c1[engine_name]:
                row["c1_p50_us"] = round(statistics.median(c1[engine_name]), 1)
                row["c1_requests"] = len(c1[engine_name])
            for c in concurrency:
                if c != 1:
                    row[f"c{c}_rps_rounds"] = [round(r, 1) for r in rps[(engine_name, c)]]
                    row[f"c{c}_rps"] = round(statistics.median(rps[(engine_name, c)]), 1)
            rows.append(row)
    return rows


def main() -> None:
    """Build the models, measure, print markdown tables, write the raw results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="timed calls per cell (fraud)")
    parser.add_argument("--stack", action="store_true", help="through the stack instead (fraud)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per stack measurement")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[1, 64],
        help="--stack: comma-separated levels; 1 is p50 latency, more is req/s (default 1,64)",
    )
    args = parser.parse_args()
    import onnxruntime

    t0 = time.monotonic()
    result: dict[str, Any] = {
        "onnxruntime": onnxruntime.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "loadavg_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        root = Path(tmp)
        if args.stack:
            dirs = build_versions(root, "fraud", [64, 32, 2])
            if OPENVINO_PYTHON.exists():
                add_openvino(dirs, root)
                probe = [
                    str(OPENVINO_PYTHON),
                    "-c",
                    "import onnxruntime; print(onnxruntime.__version__)",
                ]
                ov = subprocess.run(probe, capture_output=True, text=True, check=True)
                result["onnxruntime_openvino"] = ov.stdout.strip()
            else:
                print("no .venvs/openvino (scripts/bootstrap-openvino.sh): no OpenVINO EP row")
            result["concurrency"] = args.concurrency
            stack_rows = through_stack(dirs, root / "stack-run", args.seconds, args.concurrency)
            heads = ["c=1 p50 µs" if c == 1 else f"c={c} req/s" for c in args.concurrency]
            print("| model | engine | " + " | ".join(heads) + " |")
            print("|---|---|" + "---|" * len(heads))
            for r in stack_rows:
                cells = [
                    str(r["c1_p50_us"] if c == 1 else r[f"c{c}_rps"]) for c in args.concurrency
                ]
                print(f"| fraud | {r['engine']} | " + " | ".join(cells) + " |")
            result["stack"] = stack_rows
        else:
            import torch

            result["torch"] = torch.__version__
            print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}")
            print("| model | engine | batch | p50 µs | p90 µs | vs ONNX p50 | max abs diff |")
            print("|---|---|---|---|---|---|---|")
            engine_rows = []
            for name, sizes, runs in (
                ("fraud", [64, 32, 2], args.runs),
                ("heavy", HEAVY, max(50, args.runs // 20)),
            ):
                rows = engine_only(build_versions(root, name, sizes), runs)
                onnx = {r["batch"]: r["p50_us"] for r in rows if r["engine"] == "onnxruntime"}
                for r in rows:
                    r["model"] = name
                    ratio = r["p50_us"] / onnx[r["batch"]]
                    print(
                        f"| {name} | {r['engine']} | {r['batch']} | {r['p50_us']} "
                        f"| {r['p90_us']} | {ratio:.2f}x | {r['max_abs_diff']:.2e} |"
                    )
                engine_rows += rows
            result["engine_only"] = engine_rows
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["loadavg_after"] = os.getloadavg()[0]
    kind = "stack" if args.stack else "engine"
    out = REPO / "bench" / "results" / f"engines-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"\n{result['seconds']} s; load average {result['loadavg_before']:.1f} → "
        f"{result['loadavg_after']:.1f}; raw results: {out.relative_to(REPO)}"
    )


if __name__ == "__main__":
    main()
