"""Serve an ONNX model with NVIDIA Triton through PyTriton, for the peer benchmark.

Runs inside its own virtualenv (``bench/.venvs/pytriton``, made by
``bench/run_all.py``): Triton's dynamic batcher (max batch ``--max-batch``,
``--delay-us`` queue delay) in front of a Python inference callable that runs
the SAME ``model.onnx`` with onnxruntime, ``--instances`` model instances of
one intra-op thread each (the inferbus workers get the same compute).

Usage (from the peer venv)::

    bench/.venvs/pytriton/bin/python bench/peers/pytriton_server.py \
        --model-dir bench/models/heavy --grpc-port 18001 --http-port 18000 --metrics-port 18002
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

_NP = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


def make_infer(
    model_path: Path, threads: int, out_name: str
) -> Callable[..., dict[str, np.ndarray]]:
    """An inference callable with its own onnxruntime session."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        (result,) = sess.run([out_name], inputs)
        return {out_name: result}

    return infer


def main() -> None:
    """Bind the model and serve until killed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, action="append", required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=1000)
    args = p.parse_args()
    config = TritonConfig(
        grpc_address="127.0.0.1",
        http_address="127.0.0.1",
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        exit_on_error=True,
    )
    # Loopback only, a benchmark: no access token. perf_analyzer calls the
    # statistics and shared-memory endpoints, which PyTriton restricts by default.
    security = TritonSecurityConfig(restricted_endpoints=[])
    with Triton(config=config, security_config=security) as triton:
        for model_dir in args.model_dir:
            cfg = json.loads((model_dir / "config.json").read_text())
            inp, out = cfg["inputs"][0], cfg["outputs"][0]
            # PyTriton shapes leave out the batch dimension.
            in_shape, out_shape = (int(inp["shape"][-1]),), (int(out["shape"][-1]),)
            triton.bind(
                model_name=cfg["name"],
                infer_func=[
                    make_infer(model_dir / cfg.get("file", "model.onnx"), args.threads, out["name"])
                    for _ in range(args.instances)
                ],
                inputs=[Tensor(name=inp["name"], dtype=_NP[inp["datatype"]], shape=in_shape)],
                outputs=[Tensor(name=out["name"], dtype=_NP[out["datatype"]], shape=out_shape)],
                config=ModelConfig(
                    max_batch_size=args.max_batch,
                    batcher=DynamicBatcher(max_queue_delay_microseconds=args.delay_us),
                ),
                strict=False,
            )
        triton.serve()


if __name__ == "__main__":
    main()
