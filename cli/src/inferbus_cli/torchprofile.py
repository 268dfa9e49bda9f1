"""torch's profiler over a PyTorch version (``inferbus models profile`` of kind pytorch).

Runs where the CLI runs, like ONNX Runtime's profile (`inferbus_cli.optimize`):
the program is loaded here, so the CLI's environment needs torch. torch is no
dependency of the CLI (it lives in ``.venvs/torch``, made by
``scripts/bootstrap-torch.sh``, which installs the CLI there too); without it
`TorchMissing` says so and how to get it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.datatypes import numpy_dtype
from inferbus_common.modelconfig import ModelConfig


class TorchMissing(RuntimeError):
    """The CLI's environment cannot import torch."""


def _torch(what: str) -> Any:
    try:
        import torch
    except ImportError as exc:
        raise TorchMissing(
            f"{what} is a PyTorch program: torch's profiler runs where the CLI runs, and this "
            f"environment has no torch ({exc}). Run the CLI of the PyTorch environment, "
            ".venvs/torch/bin/inferbus models profile ... (scripts/bootstrap-torch.sh makes "
            "it), or pip install torch==2.13.0 next to the CLI"
        ) from None
    return torch


def sample_inputs(config: ModelConfig, batch: int, *, seed: int = 0) -> list[np.ndarray]:
    """Random inputs for the config's engine tensors at `batch` rows, in config order.

    Dimensions other than the batch axis given as -1 become 1; floats are
    standard normal, integers and booleans 0 or 1.
    """
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in config.engine_view().inputs:
        dims = [d if d > 0 else 1 for d in spec.shape]
        if config.max_batch_size > 0 and dims:
            dims[0] = batch
        dtype = numpy_dtype(spec.datatype)
        if np.issubdtype(dtype, np.floating):
            arrays.append(rng.standard_normal(dims).astype(dtype))
        else:
            arrays.append(rng.integers(0, 2, size=dims).astype(dtype))
    return arrays


def profile_ops(
    program: Path,
    config: ModelConfig,
    batch: int,
    *,
    what: str,
    runs: int = 20,
    top: int = 10,
) -> list[dict[str, Any]]:
    """torch's profiler over `runs` calls at `batch` rows: operators by self time, most first.

    On the config's first provider when it is ``cuda`` and torch sees a GPU
    (CUDA time counted then), else on the CPU.

    Raises:
        TorchMissing: torch is not importable here.
    """
    torch = _torch(what)
    on_gpu = config.engine.providers[0] == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if program.suffix == ".pt2":
        module = torch.export.load(str(program)).module().to(device)
    else:
        module = torch.jit.load(str(program), map_location=device).eval()
    args = [torch.from_numpy(a).to(device) for a in sample_inputs(config, batch)]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        for _ in range(3):  # warm-up: TorchScript's profiling executor optimises on early calls
            module(*args)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(runs):
                module(*args)
            if on_gpu:
                torch.cuda.synchronize()
    events = list(prof.key_averages())
    attr = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    whole = sum(getattr(e, attr) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
    return [
        {
            "op": e.key,
            "total_us": round(float(getattr(e, attr)), 1),
            "per_run_us": round(float(getattr(e, attr)) / runs, 1),
            "calls": int(e.count),
            "share": round(float(getattr(e, attr)) / whole, 4),
        }
        for e in ranked
        if getattr(e, attr) > 0
    ]


def profile_batches(
    program: Path, config: ModelConfig, batches: Sequence[int], *, what: str, top: int
) -> dict[str, list[dict[str, Any]]]:
    """`profile_ops` at each batch size, keyed by the size as text."""
    return {str(b): profile_ops(program, config, b, what=what, top=top) for b in batches}
