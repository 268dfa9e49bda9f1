"""Build the compute-heavy benchmark model: MLP 256 → 1536 x 5 → 16 in ONNX.

Same builder and CLI as ``examples/fraud/make_model.py`` (fixed seed, symbolic
batch dimension, ``model.onnx`` + ``config.json`` + ``.gitignore`` in
``--out``); it exists so benchmarks measure a model where compute, not the
platform's overhead, dominates.

Usage::

    uv run python bench/models/make_heavy.py [--out bench/models/heavy]
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path(__file__).resolve().parent / "heavy"
LAYERS = [256, 1536, 1536, 1536, 1536, 1536, 16]
"""Input width, five hidden layers of 1536, 16 classes."""


def _load_builder() -> ModuleType:
    # The example script is not a package; load it by path so both generators
    # share one MLP builder instead of two copies.
    path = _ROOT / "examples" / "fraud" / "make_model.py"
    spec = importlib.util.spec_from_file_location("inferbus_example_make_model", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> None:
    """Write the heavy model and its config into ``--out``."""
    builder = _load_builder()
    out = builder.parse_args(argv, DEFAULT_OUT, "Build the compute-heavy benchmark ONNX model.")
    config = builder.model_config("heavy", LAYERS[0], LAYERS[-1])
    builder.write_model(out, builder.build_mlp("heavy", LAYERS), config)
    print(
        json.dumps({"out": str(out), "model": config.name, "files": ["model.onnx", "config.json"]})
    )


if __name__ == "__main__":
    main()
