"""inferbus_cli.optimize on the fraud example: fp16 / int8 variants, error, speed, profile."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from inferbus_cli import optimize

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fraud(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fraud")
    subprocess.run(
        [sys.executable, str(ROOT / "examples/fraud/make_model.py"), "--out", str(out)], check=True
    )
    return out / "model.onnx"


def test_fp16_keeps_float32_io_and_stays_close(fraud: Path, tmp_path: Path) -> None:
    dst = tmp_path / "fp16.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimize.to_fp16(fraud, dst)
    assert [i.type for i in optimize.session(dst).get_inputs()] == [
        i.type for i in optimize.session(fraud).get_inputs()
    ]
    err = optimize.compare(fraud, dst, optimize.sample_inputs(fraud, 64))
    assert err["max_abs_diff"] is not None and 0 < err["max_abs_diff"] < 1e-2


@pytest.mark.parametrize("static", [False, True])
def test_int8_static_and_dynamic(fraud: Path, tmp_path: Path, static: bool) -> None:
    dst = tmp_path / "int8.onnx"
    calib = [optimize.sample_inputs(fraud, 16, seed=s) for s in range(4)] if static else None
    assert optimize.to_int8(fraud, dst, calib) == ("static" if static else "dynamic")
    err = optimize.compare(fraud, dst, optimize.sample_inputs(fraud, 64))
    assert err["max_abs_diff"] is not None and err["max_abs_diff"] < 0.2
    assert err["rows"] == 64
    sp = optimize.speed(dst, (1, 32), runs=5)
    assert set(sp) == {"batch1_p50_us", "batch32_p50_us"} and all(v > 0 for v in sp.values())


def test_profile_ops_names_operators(fraud: Path) -> None:
    ops = optimize.profile_ops(fraud, optimize.sample_inputs(fraud, 8), runs=3)
    assert ops and all(o["total_us"] >= 0 and o["calls"] >= 3 for o in ops)
    assert {o["op"] for o in ops} & {"Gemm", "MatMul", "Relu", "Add", "Sigmoid", "Softmax"}
