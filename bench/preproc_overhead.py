"""Overhead per batch of running ``preprocessor.py`` in a sandboxed process (issue 27).

The same identity ``preprocess`` is called (a) in-process, as a plain
function on the numpy dict, and (b) through the worker's `ScriptPool` (one
sandboxed child, the batch out and back as ``IBT1`` frames over pipes, the
result checked against the config as the worker does), for batches of
growing size. The difference is what the process hop costs per batch::

    uv run python bench/preproc_overhead.py            # table
    uv run python bench/preproc_overhead.py --json     # one JSON object

Wall time per call on the event loop, median and p99 of ``--calls`` calls
after ``--warmup``; one call at a time (a runner slot's view).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.scriptpool import ScriptLimits, ScriptPool, ScriptProcessing

SCRIPT = "def preprocess(inputs):\n    return inputs\n"

CASES = [
    ("1 x 64 FP32 (fraud, one row)", (1, 64)),
    ("64 x 64 FP32", (64, 64)),
    ("256 x 64 FP32", (256, 64)),
    ("8 x 3 x 224 x 224 FP32 (4.8 MB)", (8, 3, 224, 224)),
    ("32 x 3 x 224 x 224 FP32 (19 MB)", (32, 3, 224, 224)),
]


def _config(shape: tuple[int, ...]) -> ModelConfig:
    dims = [-1, *shape[1:]]
    return ModelConfig.model_validate(
        {
            "name": "bench",
            "max_batch_size": 64,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": dims}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            "processing": {"python": "preprocessor.py"},
        }
    )


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
    }


async def _run(calls: int, warmup: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="preproc-bench-") as tmp:
        directory = Path(tmp)
        (directory / "preprocessor.py").write_text(SCRIPT)
        pool = ScriptPool(directory, "preprocessor.py", "bench/1", ScriptLimits(pool_size=1))
        t0 = time.perf_counter()
        await pool.start()
        start_s = time.perf_counter() - t0
        namespace: dict[str, object] = {}
        exec(SCRIPT, namespace)
        local = namespace["preprocess"]
        assert callable(local)
        try:
            for label, shape in CASES:
                x = np.random.default_rng(0).random(shape, dtype=np.float32)
                script = ScriptProcessing(_config(shape), pool)
                inline: list[float] = []
                hop: list[float] = []
                for i in range(warmup + calls):
                    t = time.perf_counter()
                    local({"x": x})
                    a = time.perf_counter() - t
                    t = time.perf_counter()
                    await script.pre({"x": x}, shape[0], time.monotonic() + 30)
                    b = time.perf_counter() - t
                    if i >= warmup:
                        inline.append(a)
                        hop.append(b)
                frame_bytes = memoryview(tensor_from_numpy("x", x).data).nbytes
                rows.append(
                    {
                        "batch": label,
                        "bytes": frame_bytes,
                        "in_process": _stats(inline),
                        "subprocess": _stats(hop),
                    }
                )
        finally:
            await pool.close()
    rows.append({"start_s": start_s, "sandbox": pool.sandbox})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = asyncio.run(_run(args.calls, args.warmup))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    tail = rows.pop()
    print(f"{'batch':36} {'in-process med/p99 us':>24} {'subprocess med/p99 us':>24}")
    for row in rows:
        a, b = row["in_process"], row["subprocess"]
        assert isinstance(a, dict) and isinstance(b, dict)
        print(
            f"{row['batch']!s:36} {a['median_us']:>11.1f} / {a['p99_us']:<10.1f} "
            f"{b['median_us']:>11.1f} / {b['p99_us']:<10.1f}"
        )
    print(f"pool start (1 process, sandbox + numpy import): {tail['start_s']:.3f} s")
    print(f"sandbox: {json.dumps(tail['sandbox'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
