"""`inferbus replay` comparison rules, `inferbus profile` sample files, duration parsing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from inferbus_cli.__main__ import main
from inferbus_cli.busclient import parse_duration
from inferbus_cli.commands.profile import load_sample
from inferbus_cli.commands.replay import (
    build_replay_request,
    compare_answers,
    compare_output,
)
from inferbus_common.capture import CapturedRequest
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.drift import parse_profile


def test_floats_compare_within_tolerance_and_report_argmax_flips() -> None:
    a = np.array([[0.2, 0.8], [0.6, 0.4]], dtype=np.float32)
    assert compare_output("p", a, a + 1e-7, atol=1e-5, rtol=1e-4) is None
    flipped = a.copy()
    flipped[1] = [0.4, 0.6]
    d = compare_output("p", a, flipped, atol=1e-5, rtol=1e-4)
    assert d is not None and d.reason == "values"
    assert d.mismatched == 2 and d.argmax_changed_rows == 1
    assert d.max_abs_diff == pytest.approx(0.2, abs=1e-6)
    # Close values but a different top class (a tie broken otherwise) still differ.
    tie = np.array([[0.5, 0.5]], dtype=np.float32)
    near = np.array([[0.5, 0.5000001]], dtype=np.float32)
    d = compare_output("p", tie, near, atol=1e-3, rtol=0)
    assert d is not None and d.argmax_changed_rows == 1 and d.mismatched == 0


def test_ints_bytes_and_shapes_compare_exactly() -> None:
    a = np.array([1, 2, 3], dtype=np.int64)
    assert compare_output("c", a, a.copy(), atol=10, rtol=10) is None
    d = compare_output("c", a, np.array([1, 2, 4], dtype=np.int64), atol=10, rtol=10)
    assert d is not None and d.mismatched == 1
    words = np.array([b"a", b"b"], dtype=object)
    assert compare_output("w", words, words.copy(), atol=0, rtol=0) is None
    d = compare_output("w", words, np.array([b"a", b"c"], dtype=object), atol=0, rtol=0)
    assert d is not None and d.mismatched == 1
    d = compare_output("c", a, a.reshape(3, 1), atol=0, rtol=0)
    assert d is not None and d.reason == "shape"
    diff = compare_answers("r", {"c": a, "gone": a}, {"c": a}, atol=0, rtol=0)
    assert diff is not None and [o.reason for o in diff.outputs] == ["missing"]


def test_replay_request_is_pinned_and_renamed() -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    cap = CapturedRequest(
        request_id="abc",
        model="fraud",
        version="1",
        digest="",
        ts_unix_ms=0,
        inputs=[tensor_from_numpy("input", x)],
        outputs=[],
        requested_outputs=["probabilities"],
    )
    req = build_replay_request(cap, "2")
    assert (req.model_name, req.model_version, req.id) == ("fraud", "2", "abc.replay")
    assert list(req.inputs[0].shape) == [2, 4] and req.inputs[0].datatype == "FP32"
    assert req.raw_input_contents[0] == x.tobytes()
    assert [o.name for o in req.outputs] == ["probabilities"]


def test_durations() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("1h") == 3600
    assert parse_duration("2d") == 172800
    assert parse_duration("250ms") == 0.25
    for bad in ("", "1w", "-1h", "0s", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)


def test_profile_from_csv_with_header_and_npz(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(300, 3))
    csv = tmp_path / "sample.csv"
    csv.write_text("a,b,c\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in rows) + "\n")
    assert load_sample(csv, "features")["features"].shape == (300, 3)
    out = tmp_path / "profile.json"
    code = main(["profile", "m", "--sample", str(csv), "--input", "features", "--out", str(out)])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["features"] == 3
    profile = parse_profile(out.read_bytes())
    assert [f.name for f in profile.features] == ["features[0]", "features[1]", "features[2]"]

    npz = tmp_path / "sample.npz"
    np.savez(npz, x=rows.astype(np.float32), code=rng.integers(0, 4, size=300))
    outputs = tmp_path / "outputs.npy"
    np.save(outputs, rng.random(size=(300, 2)))
    code = main(
        ["profile", "m", "--sample", str(npz), "--outputs", str(outputs), "--out", str(out)]
    )
    assert code == 0
    profile = parse_profile(out.read_bytes())
    kinds = {f.name: f.kind for f in profile.features}
    assert kinds["code"] == "categorical" and kinds["x[0]"] == "continuous"
    assert "probabilities[1]" in kinds
    capsys.readouterr()

    assert main(["profile", "m", "--sample", str(tmp_path / "x.parquet")]) == 1
    assert "use a .npy" in capsys.readouterr().err
