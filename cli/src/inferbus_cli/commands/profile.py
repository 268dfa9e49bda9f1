"""``inferbus profile``: build a version's drift reference (``profile.json``) from a sample.

The sample is what the model is expected to see: ``.npy`` (one input, rows
first), ``.npz`` (one array per tensor, named like the tensors) or ``.csv``
(numbers, one row per line, an optional header). Outputs of the model on the
same rows may be given too (``--outputs``), so their drift is watched as well.
Put the result in the version directory before ``inferbus models push``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from inferbus_common.drift import build_profile


def load_sample(path: Path, name: str) -> dict[str, np.ndarray]:
    """Tensor name → array from a ``.npy``, ``.npz`` or ``.csv`` file.

    Raises:
        ValueError: an unknown file type or unreadable content.
    """
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return {name: np.load(path, allow_pickle=False)}
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    if suffix == ".csv":
        with path.open() as fh:
            first = fh.readline()
        try:
            [float(v) for v in first.strip().split(",")]
            skip = 0
        except ValueError:
            skip = 1  # a header line
        array = np.loadtxt(path, delimiter=",", skiprows=skip, dtype=np.float64, ndmin=2)
        return {name: array}
    raise ValueError(f"{path}: use a .npy, .npz or .csv sample")


def run(args: argparse.Namespace) -> int:
    """Write the profile; 1 with a message when the sample cannot be profiled."""
    try:
        tensors = load_sample(Path(args.sample), args.input)
        if args.outputs:
            tensors.update(load_sample(Path(args.outputs), args.output))
        profile = build_profile(tensors, model=args.model, bins=args.bins)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.write_text(profile.model_dump_json() + "\n")  # compact: it travels in a KV value
    summary = {
        "out": str(out),
        "model": args.model,
        "features": len(profile.features),
        "rows": min(f.count for f in profile.features),
        "tensors": sorted(profile.tensors()),
    }
    print(json.dumps(summary))
    return 0
