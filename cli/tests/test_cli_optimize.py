"""`inferbus models optimize` and `models profile` against the real registry (in process)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from inferbus_cli.__main__ import main
from inferbus_registry.app import RegistryApp


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_optimize_fp16_int8_and_profile(
    registry: RegistryApp, fraud_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = ["--registry", f"127.0.0.1:{registry.grpc_port}"]
    assert (
        await _cli("models", "push", str(fraud_model), "--name", "fraud", "--version", "1", *reg)
        == 0
    )
    capsys.readouterr()

    assert await _cli("models", "optimize", "fraud", "1", "--fp16", *reg) == 0
    fp16 = json.loads(capsys.readouterr().out.split("\n", 2)[2])
    assert fp16["version"] == "1-fp16" and fp16["precision"] == "fp16"
    assert 0 < fp16["error"]["max_abs_diff"] < 1e-2
    assert fp16["speed_cpu_p50_us"]["optimized"]["batch32_p50_us"] > 0

    calib = tmp_path / "calib.npz"
    rng = np.random.default_rng(3)
    np.savez(calib, input=rng.standard_normal((64, 64)).astype(np.float32))
    code = await _cli(
        "models", "optimize", "fraud", "stable", "--int8", "--calibration", str(calib),
        "--to", "1-q8", *reg,
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    int8 = json.loads(out.out.split("\n", 2)[2])
    assert int8["quantization"] == "static" and int8["error"]["rows"] == 64
    assert int8["error"]["max_abs_diff"] < 0.2

    # Recorded with the version, aliases untouched.
    assert await _cli("models", "get", "fraud", "--version", "1-q8", *reg) == 0
    got = json.loads(capsys.readouterr().out)
    assert "optimization.json" in [f["path"] for f in got["files"]] and got["aliases"] == []
    dl = tmp_path / "rec.json"
    assert await _cli(
        "models", "download", "fraud", "--version", "1-q8", "--file", "optimization.json",
        "-o", str(dl), *reg,
    ) == 0  # fmt: skip
    assert json.loads(dl.read_text())["source_version"] == "1"
    capsys.readouterr()

    assert await _cli("models", "profile", "fraud", "1", "--batch", "1,32", *reg) == 0
    text = capsys.readouterr().out
    assert "batch 1:" in text and "batch 32:" in text and "us/run" in text
    assert await _cli("models", "profile", "fraud", "1", "--batch", "8", "--json", *reg) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["batches"]["8"] and prof["batches"]["8"][0]["op"]
