"""The repository's example models and a concurrent client, as tests use them.

Tests build the fraud example with the repository's own script (what a user
runs), never a copy of it, and fire one-row requests all at once to see that a
version batches.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: The checkout (libs/testing/src/inferbus_testing/examples.py → root).
REPO = Path(__file__).resolve().parents[4]
FRAUD_SCRIPT = REPO / "examples" / "fraud" / "make_model.py"


def make_fraud_model(out: Path, timeout: float = 120) -> Path:
    """Write the fraud example (``model.onnx``, ``config.json``) into `out`; return `out`.

    Raises:
        subprocess.CalledProcessError: the script failed (its stderr attached).
    """
    subprocess.run(
        [sys.executable, str(FRAUD_SCRIPT), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    return out


async def infer_concurrently(
    grpc_url: str, model: str, rows: list[np.ndarray], output: str = "probabilities"
) -> list[Any]:
    """Send each FP32 row as its own gRPC request on one channel, all in flight at
    once (tensor ``input``); return `output` of each answer, in order."""
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(grpc_url)

    async def one(x: np.ndarray) -> Any:
        inp = grpcaio.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return (await client.infer(model, [inp], client_timeout=60)).as_numpy(output)

    try:
        return list(await asyncio.gather(*(one(x) for x in rows)))
    finally:
        await client.close()
