"""Drift profiles and statistics: bins from quantiles, PSI, KS, categorical features, windows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferbus_common.drift import (
    DriftReport,
    FeatureDrift,
    SlidingWindow,
    build_profile,
    evaluate,
    ks,
    parse_profile,
    profiled_columns,
    psi,
)


def _sample(rows: int, seed: int, shift: dict[int, float] | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, size=(rows, 8)).astype(np.float32)
    for col, delta in (shift or {}).items():
        x[:, col] += delta
    return x


def test_profile_bins_hold_equal_shares_of_the_reference() -> None:
    profile = build_profile({"input": _sample(5000, 1)}, model="m", bins=10)
    assert [f.name for f in profile.features] == [f"input[{i}]" for i in range(8)]
    f0 = profile.features[0]
    assert f0.kind == "continuous"
    assert len(f0.edges) == 9 and len(f0.expected) == 10
    assert all(abs(e - 0.1) < 0.01 for e in f0.expected)
    assert len(f0.quantiles) == 101
    # Round trip through JSON (what is pushed as profile.json).
    again = parse_profile(profile.model_dump_json())
    assert again == profile


def test_psi_and_ks_are_low_for_the_same_distribution_and_high_for_a_shift() -> None:
    profile = build_profile({"input": _sample(5000, 1)})
    live = _sample(2000, 2, shift={2: 1.0, 5: -1.5})
    result = evaluate(profile, {"input": live.astype(np.float64)})
    high = {name for name, fd in result.items() if fd.psi > 0.2}
    assert high == {"input[2]", "input[5]"}
    for name, fd in result.items():
        if name not in high:
            assert fd.psi < 0.05, (name, fd)
            assert fd.ks is not None and fd.ks < 0.06, (name, fd)
    assert result["input[2]"].ks is not None and result["input[2]"].ks > 0.3


def test_psi_matches_the_textbook_formula() -> None:
    profile = build_profile({"x": np.arange(1000, dtype=np.float64)}, bins=4)
    feature = profile.features[0]
    assert feature.name == "x"
    # Every live value in the first quarter: one bin holds all, three are empty.
    live = np.zeros(100)
    expected = [0.25, 0.25, 0.25, 0.25]
    actual = [1.0, 1e-4, 1e-4, 1e-4]
    textbook = sum((a - e) * np.log(a / e) for a, e in zip(actual, expected, strict=True))
    assert psi(feature, live) == pytest.approx(textbook, rel=1e-6)
    assert ks(feature, live) == pytest.approx(0.99, abs=0.011)


def test_categorical_features_count_unknown_values_in_the_other_bin() -> None:
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 3, size=(3000, 1)).astype(np.int64)
    profile = build_profile({"code": codes})
    feature = profile.features[0]
    assert feature.kind == "categorical"
    assert feature.edges == [0.0, 1.0, 2.0]
    assert feature.expected[-1] == 0.0
    assert ks(feature, np.zeros(10)) is None
    same = rng.integers(0, 3, size=1000).astype(np.float64)
    assert psi(feature, same) < 0.02
    unseen = np.full(1000, 7.0)
    assert psi(feature, unseen) > 1.0


def test_profile_refuses_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least 10"):
        build_profile({"x": np.zeros((5, 2))})
    bad = np.ones((100, 2))
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        build_profile({"x": bad})
    with pytest.raises(ValueError, match=r"profile\.json is invalid"):
        parse_profile(json.dumps({"features": [{"name": "a"}]}))


def test_window_keeps_the_last_rows() -> None:
    w = SlidingWindow(5, 2)
    w.add(np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    assert len(w) == 3
    w.add(np.array([[4.0, 4.0], [5.0, 5.0], [6.0, 6.0]]))
    assert len(w) == 5
    assert sorted(w.values()[:, 0].tolist()) == [2.0, 3.0, 4.0, 5.0, 6.0]
    w.add(np.arange(20, dtype=np.float64).reshape(10, 2))
    assert sorted(w.values()[:, 0].tolist()) == [10.0, 12.0, 14.0, 16.0, 18.0]
    assert w.added == 16
    with pytest.raises(ValueError):
        w.add(np.zeros((2, 3)))


def test_report_ranks_the_worst_features_first() -> None:
    report = DriftReport(
        model="m",
        version="1",
        ts_unix_ms=1,
        rows=10,
        features={
            "a": FeatureDrift(psi=0.01, ks=0.02),
            "b": FeatureDrift(psi=0.5, ks=0.3),
            "c": FeatureDrift(psi=0.2),
        },
    )
    assert [name for name, _ in report.worst(2)] == ["b", "c"]


def test_windows_of_profiled_columns_only() -> None:
    full = build_profile({"input": _sample(3000, 4)})
    subset = full.model_copy(update={"features": [full.features[6], full.features[2]]})
    cols = profiled_columns(subset)
    assert cols == {"input": [2, 6]}
    live = _sample(1000, 5, shift={6: 2.0}).astype(np.float64)
    result = evaluate(subset, {"input": live[:, cols["input"]]}, cols)
    assert set(result) == {"input[2]", "input[6]"}
    assert result["input[6]"].psi > 0.2 > result["input[2]"].psi
