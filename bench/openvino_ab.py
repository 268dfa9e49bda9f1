"""OpenVINO EP vs ONNX Runtime's CPU EP on the example models (issue 27).

onnxruntime-openvino replaces onnxruntime, so this runs in an environment of
its own, needing only that wheel and numpy (it imports nothing of inferbus)::

    uv venv /tmp/ovenv -p 3.11
    uv pip install -p /tmp/ovenv/bin/python onnxruntime-openvino==1.24.1 numpy
    uv run python examples/fraud/make_model.py --out /tmp/ov/fraud
    uv run python bench/models/make_heavy.py --out /tmp/ov/heavy
    /tmp/ovenv/bin/python bench/openvino_ab.py /tmp/ov/fraud /tmp/ov/heavy

One thread for the CPU EP (the worker's default); OpenVINO's CPU device with
its own threading (``num_of_threads`` 1). p50 of 200 calls after 10 warm-ups;
error: max abs difference of the first output against the CPU EP.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def _session(model: Path, provider: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    if provider == "openvino":
        ep = [("OpenVINOExecutionProvider", {"device_type": "CPU", "num_of_threads": "1"})]
    else:
        ep = ["CPUExecutionProvider"]
    return ort.InferenceSession(str(model), opts, providers=ep)


def _p50(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> float:
    for _ in range(10):
        sess.run(None, feeds)
    times = []
    for _ in range(200):
        start = time.perf_counter_ns()
        sess.run(None, feeds)
        times.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(times)


def main(dirs: list[str]) -> None:
    print(f"onnxruntime {ort.__version__}, providers {ort.get_available_providers()}")
    print("| model | batch | CPU EP p50 µs | OpenVINO EP p50 µs | CPU/OpenVINO | max abs diff |")
    print("|---|---|---|---|---|---|")
    for d in dirs:
        model = Path(d) / "model.onnx"
        cpu, ov = _session(model, "cpu"), _session(model, "openvino")
        assert ov.get_providers()[0] == "OpenVINOExecutionProvider", ov.get_providers()
        spec = cpu.get_inputs()[0]
        for batch in (1, 32):
            x = np.random.default_rng(batch).standard_normal((batch, spec.shape[1]))
            feeds = {spec.name: x.astype(np.float32)}
            diff = np.abs(cpu.run(None, feeds)[0] - ov.run(None, feeds)[0]).max()
            a, b = _p50(cpu, feeds), _p50(ov, feeds)
            print(f"| {Path(d).name} | {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {diff:.2e} |")


if __name__ == "__main__":
    main(sys.argv[1:])
