"""Build the fraud example's MLP as a PyTorch program: TorchScript or torch.export.

Same architecture and weights as ``examples/fraud/make_model.py`` (the same
seed, drawn in the same order), so the ONNX model and these programs compute
the same function::

    input FP32 [-1, 64] → Linear 64→32 → ReLU → Linear 32→2 → Softmax → probabilities

Runs with torch (``.venvs/torch``, made by ``scripts/bootstrap-torch.sh``)::

    .venvs/torch/bin/python examples/torch-mlp/build.py --out DIR --format pt
    .venvs/torch/bin/python examples/torch-mlp/build.py --out DIR --format pt2 --logits

``--format pt`` writes ``model.pt`` (``torch.jit.script``), ``pt2`` writes
``model.pt2`` (``torch.export`` with a dynamic batch axis, 1..max batch).
``--logits`` adds a second output, ``logits`` (the TorchScript program then
returns a dict by name, the exported one a tuple in config order).
``--no-config`` leaves config.json out (the registry derives a ``.pt2``'s).
Prints a JSON line: the directory and the files written.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

SEED = 20240611
"""The fraud model's seed (examples/fraud/make_model.py)."""


class MLP(torch.nn.Module):
    """Linear layers with ReLU between them, Softmax at the end: ``probabilities``."""

    def __init__(self, sizes: Sequence[int], *, seed: int = SEED) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        layers = []
        for fan_in, fan_out in pairwise(sizes):
            # Drawn as examples/fraud draws them: w (in x out), then b.
            w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out)).astype(np.float32)
            b = rng.normal(0.0, 0.01, size=(fan_out,)).astype(np.float32)
            layer = torch.nn.Linear(fan_in, fan_out)
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(w.T.copy()))
                layer.bias.copy_(torch.from_numpy(b))
            layers.append(layer)
        self.layers = torch.nn.ModuleList(layers)

    def scores(self, input: torch.Tensor) -> torch.Tensor:
        """The last layer's output (logits)."""
        x = input
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < n - 1:
                x = torch.relu(x)
        return x

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.scores(input), dim=-1)


class MLPDict(MLP):
    """Both outputs by name (how a TorchScript program may answer)."""

    def forward(self, input: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x = self.scores(input)
        return {"probabilities": torch.softmax(x, dim=-1), "logits": x}


class MLPTuple(MLP):
    """Both outputs in config order."""

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x = self.scores(input)
        return torch.softmax(x, dim=-1), x


def config(fmt: str, sizes: Sequence[int], logits: bool, max_batch: int) -> dict[str, object]:
    """The version's config.json."""
    outputs = [{"name": "probabilities", "datatype": "FP32", "shape": [-1, sizes[-1]]}]
    if logits:
        outputs.append({"name": "logits", "datatype": "FP32", "shape": [-1, sizes[-1]]})
    return {
        "platform": "pytorch_libtorch",
        "file": f"model.{fmt}",
        "engine": {"kind": "pytorch", "providers": ["cpu"]},
        "max_batch_size": max_batch,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, sizes[0]]}],
        "outputs": outputs,
        "batching": {"max_queue_delay_us": 2000},
    }


def build(
    out: Path,
    fmt: str,
    *,
    sizes: Sequence[int] = (64, 32, 2),
    logits: bool = False,
    max_batch: int = 32,
    with_config: bool = True,
    seed: int = SEED,
) -> list[str]:
    """Write ``model.<fmt>`` (and config.json) into `out`; returns the file names."""
    out.mkdir(parents=True, exist_ok=True)
    kind = (MLPDict if fmt == "pt" else MLPTuple) if logits else MLP
    module = kind(sizes, seed=seed).eval()
    path = out / f"model.{fmt}"
    if fmt == "pt":
        torch.jit.script(module).save(str(path))
    else:
        example = (torch.zeros(2, sizes[0]),)
        batch = torch.export.Dim("batch", min=1, max=max_batch)
        program = torch.export.export(module, example, dynamic_shapes={"input": {0: batch}})
        torch.export.save(program, str(path))
    files = [path.name]
    if with_config:
        doc = config(fmt, sizes, logits, max_batch)
        (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
        files.append("config.json")
    return files


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments, build, print what was written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="version directory written")
    parser.add_argument("--format", choices=["pt", "pt2"], default="pt")
    parser.add_argument("--sizes", default="64,32,2", help="layer widths, input to output")
    parser.add_argument("--logits", action="store_true", help="a second output, logits")
    parser.add_argument("--max-batch", type=int, default=32, help="max_batch_size (32)")
    parser.add_argument("--no-config", action="store_true", help="write no config.json")
    parser.add_argument("--seed", type=int, default=SEED, help="weights' seed (the fraud model's)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    files = build(
        args.out,
        args.format,
        sizes=sizes,
        logits=args.logits,
        max_batch=args.max_batch,
        with_config=not args.no_config,
        seed=args.seed,
    )
    print(json.dumps({"out": str(args.out), "files": files}))


if __name__ == "__main__":
    main()
