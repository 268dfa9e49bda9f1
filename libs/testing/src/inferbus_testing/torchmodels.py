"""PyTorch programs for tests, and workers that can serve them.

torch lives in ``.venvs/torch`` (``scripts/bootstrap-torch.sh``), never in the
workspace's environment: models are built and reference answers computed by
subprocesses of that interpreter (``examples/torch-mlp/build.py``), and a
worker that serves them runs with it. Its absence is why PyTorch tests skip::

    if not TORCH_PYTHON.exists(): pytest.skip(TORCH_MISSING)
    build_torch_mlp(tmp / "v1", "pt2")
    stack.push(tmp / "v1", "mlp")
    start_torch_worker(stack, "torch-worker")
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[4]
TORCH_PYTHON = REPO / ".venvs" / "torch" / "bin" / "python"
"""The interpreter of the PyTorch environment."""
TORCH_MISSING = ".venvs/torch is missing: run scripts/bootstrap-torch.sh (torch==2.13.0)"
"""Why PyTorch tests skip."""
BUILD = REPO / "examples" / "torch-mlp" / "build.py"


def build_torch_mlp(out: Path, fmt: str, *extra: str) -> Path:
    """Build the fraud MLP as ``model.<fmt>`` (``pt`` or ``pt2``) into `out`; returns `out`.

    `extra`: more arguments of examples/torch-mlp/build.py (``--logits``, ``--no-config``).
    """
    subprocess.run(
        [str(TORCH_PYTHON), str(BUILD), "--out", str(out), "--format", fmt, *extra],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


_REFERENCE = """
import sys, numpy as np, torch
path, x_path, out_path = sys.argv[1:4]
if path.endswith(".pt2"):
    module = torch.export.load(path).module()
else:
    module = torch.jit.load(path)
x = torch.from_numpy(np.load(x_path))
parts = {}
# 16 rows at a time: an exported program's batch axis has a maximum.
for start in range(0, len(x), 16):
    with torch.inference_mode():
        result = module(x[start : start + 16])
    if isinstance(result, torch.Tensor):
        result = {"0": result}
    elif isinstance(result, (tuple, list)):
        result = {str(i): r for i, r in enumerate(result)}
    for k, v in result.items():
        parts.setdefault(k, []).append(v.numpy())
np.savez(out_path, **{k: np.concatenate(v) for k, v in parts.items()})
"""


def torch_reference(model_file: Path, x: np.ndarray, work: Path) -> dict[str, np.ndarray]:
    """torch's own answer for `x`: the program run directly by ``.venvs/torch``
    (16 rows at a time).

    Keys: output names for a program that returns a dict, else ``"0"``, ``"1"``...
    """
    x_path, out_path = work / "reference-x.npy", work / "reference-out.npz"
    np.save(x_path, x)
    subprocess.run(
        [str(TORCH_PYTHON), "-c", _REFERENCE, str(model_file), str(x_path), str(out_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with np.load(out_path) as data:
        return {k: data[k] for k in data.files}


def start_torch_worker(
    stack: LocalStack, name: str = "torch-worker", pool: str = "default"
) -> ServiceProcess:
    """Start a tensor worker with the PyTorch environment's interpreter in `pool`; wait
    until it is ready."""
    worker = stack.start_worker(name, python=str(TORCH_PYTHON), env={"INFERBUS_WORKER_POOL": pool})
    worker.wait_ready(timeout=60)
    return worker
