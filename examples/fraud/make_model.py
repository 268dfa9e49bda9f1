"""Build the example fraud-scoring model: a small MLP in ONNX plus its config.json.

The model is made with `onnx.helper` from a fixed seed (nothing is downloaded),
so every run writes byte-identical files::

    input FP32 [-1, 64] → Gemm 64→32 → Relu → Gemm 32→2 → Softmax → probabilities FP32 [-1, 2]

The batch dimension is symbolic (``batch``) so the worker can run any batch
size up to ``max_batch_size``.

Usage::

    uv run python examples/fraud/make_model.py [--out examples/fraud/model]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from inferbus_common.modelconfig import ModelConfig

SEED = 20240611
"""Seed of the weights: fixed so the model (and its digest) never changes."""
DEFAULT_OUT = Path(__file__).resolve().parent / "model"
OPSET = 17


def build_mlp(
    name: str, layer_sizes: Sequence[int], *, seed: int = SEED, softmax: bool = True
) -> onnx.ModelProto:
    """Build an MLP: Gemm layers with Relu between them, Softmax at the end.

    Args:
        name: graph name.
        layer_sizes: widths from input to output, e.g. ``[64, 32, 2]``.
        seed: seed of the random weights.
        softmax: whether the last layer is followed by Softmax.

    Returns:
        A checked ONNX model with input ``input`` and output ``probabilities``,
        both with a symbolic batch dimension.
    """
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    current = "input"
    n_layers = len(layer_sizes) - 1
    for i, (fan_in, fan_out) in enumerate(pairwise(layer_sizes)):
        # He-style scaling keeps activations in a sensible range through deep stacks.
        w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out)).astype(np.float32)
        b = rng.normal(0.0, 0.01, size=(fan_out,)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == n_layers - 1
        gemm_out = ("logits" if softmax else "probabilities") if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [gemm_out]))
        current = gemm_out
        if not last:
            nodes.append(helper.make_node("Relu", [current], [f"a{i}"]))
            current = f"a{i}"
    if softmax:
        nodes.append(helper.make_node("Softmax", [current], ["probabilities"], axis=-1))
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", layer_sizes[0]])],
        [
            helper.make_tensor_value_info(
                "probabilities", TensorProto.FLOAT, ["batch", layer_sizes[-1]]
            )
        ],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="inferbus-examples"
    )
    # Older runtimes refuse models with an IR version newer than they know.
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def model_config(name: str, n_in: int, n_out: int, **overrides: object) -> ModelConfig:
    """The `config.json` of an MLP built by `build_mlp`."""
    fields: dict[str, object] = {
        "name": name,
        "platform": "onnxruntime_onnx",
        "file": "model.onnx",
        "max_batch_size": 32,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, n_in]}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, n_out]}],
        "batching": {"max_queue_delay_us": 500},
    }
    fields.update(overrides)
    return ModelConfig.model_validate(fields)


def write_model(out: Path, model: onnx.ModelProto, config: ModelConfig) -> None:
    """Write ``model.onnx``, ``config.json`` and a ``.gitignore`` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out / config.file))
    (out / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
    # Generated artifacts never belong in git.
    (out / ".gitignore").write_text("*\n")


def parse_args(argv: Sequence[str] | None, default_out: Path, description: str) -> Path:
    """Parse ``--out`` for the model generator scripts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="output directory")
    return parser.parse_args(argv).out


def main(argv: Sequence[str] | None = None) -> None:
    """Write the fraud model and its config into ``--out``."""
    out = parse_args(argv, DEFAULT_OUT, "Build the example fraud-scoring ONNX model.")
    config = model_config("fraud", 64, 2)
    write_model(out, build_mlp("fraud", [64, 32, 2]), config)
    print(
        json.dumps({"out": str(out), "model": config.name, "files": ["model.onnx", "config.json"]})
    )


if __name__ == "__main__":
    main()
