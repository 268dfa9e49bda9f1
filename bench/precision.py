"""fp16 / int8 variants of the example models against fp32: error and CPU speed (issue 27).

Builds the fraud example and the heavy MLP into a temporary directory, makes
each variant with `inferbus_cli.optimize` (the code `inferbus models optimize`
is meant to call), and prints a Markdown table: p50 microseconds per call on
ONNX Runtime's CPU provider (one thread) at batch 1 and 32, and the error of
the first output against fp32 on 256 random rows.

Usage::

    uv run python bench/precision.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from inferbus_cli import optimize

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "fraud": ROOT / "examples/fraud/make_model.py",
    "heavy": ROOT / "bench/models/make_heavy.py",
}


def _cell(sp: dict[str, float], base: dict[str, float], key: str) -> str:
    return f"{sp[key]:.1f} ({base[key] / sp[key]:.2f}x)"


def main() -> None:
    warnings.simplefilter("ignore")  # float16's "truncated to 1e-07" notes
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, script in MODELS.items():
            out = Path(tmp) / name
            subprocess.run([sys.executable, str(script), "--out", str(out)], check=True)
            fp32 = out / "model.onnx"
            sample = optimize.sample_inputs(fp32, 256, seed=1)
            calib = [optimize.sample_inputs(fp32, 32, seed=10 + i) for i in range(8)]
            variants = {"fp32": fp32}
            variants["fp16"] = out / "fp16.onnx"
            optimize.to_fp16(fp32, variants["fp16"])
            variants["int8 dynamic"] = out / "int8d.onnx"
            optimize.to_int8(fp32, variants["int8 dynamic"])
            variants["int8 static"] = out / "int8s.onnx"
            optimize.to_int8(fp32, variants["int8 static"], calib)
            base = optimize.speed(fp32)
            for label, path in variants.items():
                sp = base if label == "fp32" else optimize.speed(path)
                err = optimize.compare(fp32, path, sample)
                top1 = err["top1_agreement"]
                rows.append(
                    f"| {name} | {label} | {path.stat().st_size / 1e6:.2f} "
                    f"| {_cell(sp, base, 'batch1_p50_us')} | {_cell(sp, base, 'batch32_p50_us')} "
                    f"| {err['max_abs_diff']:.2e} | {err['mean_abs_diff']:.2e} "
                    f"| {'-' if top1 is None else f'{top1:.3f}'} |"
                )
    print(
        "| model | variant | MB | b1 p50 µs (vs fp32) | b32 p50 µs (vs fp32) "
        "| max abs diff | mean abs diff | top-1 agree |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
