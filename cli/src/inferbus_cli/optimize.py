"""Reduced-precision variants of an ONNX model, and what they cost in error and win in speed.

The work happens where the CLI runs (issue 27): `inferbus models optimize`
downloads the source artifact, converts it here and pushes the result as a
new version, so the registry stays a store of signed artifacts and needs
neither onnxconverter-common nor ONNX Runtime's quantiser.

* `to_fp16`: float16 weights and math, float32 inputs and outputs kept
  (onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)``).
* `to_int8`: ONNX Runtime's quantiser; static (QDQ, calibrated on the given
  inputs) when calibration data is given, dynamic otherwise.
* `compare`: max/mean absolute difference of the first output against the
  source on a sample, and top-1 agreement when that output is a score row.
* `speed`: ONNX Runtime CPU, p50 microseconds per call at each batch size.
* `profile_ops`: ONNX Runtime's profiler, operators by total time.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def to_fp16(src: Path, dst: Path) -> None:
    """Write `src` with float16 weights and math, float32 graph inputs and outputs."""
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    converted = float16.convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(dst))


class _Feeds:
    """Calibration reader over a list of input dicts (ONNX Runtime's CalibrationDataReader)."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
        self._it: Iterator[Mapping[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> Mapping[str, np.ndarray] | None:
        return next(self._it, None)


def to_int8(
    src: Path, dst: Path, calibration: Sequence[Mapping[str, np.ndarray]] | None = None
) -> str:
    """Write `src` quantised to int8; returns ``"static"`` or ``"dynamic"``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        if calibration:
            quantize_static(
                str(pre),
                str(dst),
                _Feeds(calibration),
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
            )
            return "static"
        quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8)
        return "dynamic"


def session(path: Path, *, profile_prefix: str | None = None, threads: int = 1) -> Any:
    """A CPU ONNX Runtime session over `path` (one intra-op thread unless told)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if profile_prefix is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def sample_inputs(model: Path, batch: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for `model` at `batch` rows, from its declared input shapes.

    Symbolic or unknown dimensions other than the first become 1.
    """
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for spec in session(model).get_inputs():
        dims = [batch] + [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape[1:]]
        dtype = _ORT_TYPES.get(spec.type, np.float32)
        if np.issubdtype(dtype, np.floating):
            feeds[spec.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[spec.name] = rng.integers(0, 2, size=dims).astype(dtype)
    return feeds


def compare(
    reference: Path, candidate: Path, feeds: Mapping[str, np.ndarray]
) -> dict[str, float | None]:
    """Error of `candidate` against `reference` on `feeds` (first output).

    ``top1_agreement`` is the share of rows whose arg-max agrees, for a 2-D
    output with more than one column (a classifier's scores); None otherwise.
    """
    want = np.asarray(session(reference).run(None, dict(feeds))[0], dtype=np.float64)
    got = np.asarray(session(candidate).run(None, dict(feeds))[0], dtype=np.float64)
    diff = np.abs(want - got)
    top1: float | None = None
    if want.ndim == 2 and want.shape[1] > 1:
        top1 = float(np.mean(want.argmax(axis=1) == got.argmax(axis=1)))
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "top1_agreement": top1,
        "rows": int(want.shape[0]),
    }


def speed(model: Path, batches: Sequence[int] = (1, 32), *, runs: int = 200) -> dict[str, float]:
    """p50 microseconds per call of `model` on the CPU provider, one thread, by batch size."""
    sess = session(model)
    out: dict[str, float] = {}
    for batch in batches:
        feeds = sample_inputs(model, batch)
        for _ in range(10):
            sess.run(None, feeds)
        times = []
        for _ in range(runs):
            start = time.perf_counter_ns()
            sess.run(None, feeds)
            times.append((time.perf_counter_ns() - start) / 1000)
        out[f"batch{batch}_p50_us"] = round(statistics.median(times), 1)
    return out


def profile_ops(
    model: Path, feeds: Mapping[str, np.ndarray], *, runs: int = 20, top: int = 10
) -> list[dict[str, Any]]:
    """ONNX Runtime's profiler over `runs` calls: operators by total time, most first."""
    with tempfile.TemporaryDirectory() as tmp:
        sess = session(model, profile_prefix=os.path.join(tmp, "ort"))
        for _ in range(runs):
            sess.run(None, dict(feeds))
        trace = json.loads(Path(sess.end_profiling()).read_text())
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in trace:
        args = event.get("args", {})
        if (
            event.get("cat") == "Node"
            and "op_name" in args
            and event["name"].endswith("_kernel_time")
        ):
            total[args["op_name"]] += event["dur"]
            calls[args["op_name"]] += 1
    whole = sum(total.values()) or 1.0
    ranked = sorted(total.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return [
        {
            "op": op,
            "total_us": round(us, 1),
            "per_run_us": round(us / runs, 1),
            "calls": calls[op],
            "share": round(us / whole, 4),
        }
        for op, us in ranked
    ]
