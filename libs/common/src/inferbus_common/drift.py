"""Reference profiles of a model's tensors and the drift statistics against them.

A **profile** (``profile.json``, pushed inside a model version) describes the
distribution each feature had in a reference sample: a histogram whose bins
come from the sample's quantiles (so every bin holds about the same share of
the reference), and, for continuous features, the sample's percentiles.

A **feature** is one column of a tensor once its non-batch dimensions are
flattened: input ``input`` of shape ``[-1, 64]`` has features ``input[0]`` to
``input[63]``; a one-column tensor is the feature named like the tensor.

Live traffic is kept in per-tensor sliding windows (the last N rows) and
compared with the profile:

* **PSI** (population stability index) over the profile's bins:
  ``sum((a - e) * ln(a / e))`` with live share ``a`` and reference share ``e``
  (both floored at `EPSILON`). Rule of thumb: < 0.1 stable, 0.1-0.2 moderate,
  > 0.2 significant drift.
* **KS** (two-sample Kolmogorov-Smirnov statistic) for continuous features:
  the largest gap between the live empirical CDF and the reference CDF,
  evaluated at the reference's percentiles (the reference keeps 101 of
  them, so the value is exact to about 0.01).

Everything here is pure numpy: the gateway computes it off the request path,
the CLI uses the same code to build profiles.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError, model_validator

PROFILE_FORMAT = 1
PROFILE_FILE = "profile.json"
"""Name of the profile inside a model version."""
EPSILON = 1e-4
"""Floor of a bin's share in PSI, so that an empty bin does not make it infinite."""
DEFAULT_BINS = 10
QUANTILES = 101
"""Percentiles a continuous feature keeps for KS (0th to 100th)."""
MAX_CATEGORIES = 20
"""Integer or boolean columns with at most this many distinct values are categorical."""


class FeatureProfile(BaseModel):
    """Reference distribution of one feature.

    For ``continuous`` features `edges` are the interior bin edges (ascending,
    ``len(expected) == len(edges) + 1``; the outer bins are open-ended). For
    ``categorical`` ones `edges` are the category values and the last share of
    `expected` is the "other" bin (values absent from the reference).
    """

    name: str
    tensor: str
    index: int = Field(ge=0)
    kind: Literal["continuous", "categorical"]
    edges: list[float]
    expected: list[float]
    quantiles: list[float] = Field(default_factory=list)
    """Continuous only: values at probabilities ``linspace(0, 1, QUANTILES)``."""
    count: int = Field(ge=1)
    """Rows of the reference sample."""

    @model_validator(mode="after")
    def _shapes(self) -> FeatureProfile:
        if len(self.expected) != len(self.edges) + 1:
            raise ValueError(
                f"feature {self.name!r}: expected has {len(self.expected)} shares for "
                f"{len(self.edges)} edges (needs edges + 1)"
            )
        if any(e < 0 for e in self.expected) or not 0.99 <= sum(self.expected) <= 1.01:
            raise ValueError(f"feature {self.name!r}: expected shares must be >= 0 and sum to 1")
        if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise ValueError(f"feature {self.name!r}: edges must be strictly ascending")
        if self.kind == "continuous" and self.quantiles and len(self.quantiles) != QUANTILES:
            raise ValueError(f"feature {self.name!r}: needs {QUANTILES} quantiles")
        return self


class Profile(BaseModel):
    """A version's reference profile (the content of ``profile.json``)."""

    format: int = PROFILE_FORMAT
    model: str = ""
    created_unix_ms: int = 0
    features: list[FeatureProfile] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Profile:
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError("feature names in a profile must be unique")
        if self.format != PROFILE_FORMAT:
            raise ValueError(f"profile format {self.format} is not supported (expected 1)")
        return self

    def tensors(self) -> dict[str, list[FeatureProfile]]:
        """Features grouped by tensor name."""
        out: dict[str, list[FeatureProfile]] = {}
        for f in self.features:
            out.setdefault(f.tensor, []).append(f)
        return out


def parse_profile(data: bytes | str) -> Profile:
    """Parse ``profile.json``.

    Raises:
        ValueError: with a message naming what is wrong.
    """
    try:
        return Profile.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise ValueError(f"profile.json is invalid: {problems}") from None


def feature_name(tensor: str, index: int, width: int, ndim: int) -> str:
    """``tensor[index]``, or just ``tensor`` for a 1-D tensor (one value per row)."""
    if ndim <= 1 and width == 1:
        return tensor
    return f"{tensor}[{index}]"


def as_rows(array: np.ndarray) -> np.ndarray:
    """A batch as 2-D ``(rows, features)``: non-batch dimensions are flattened."""
    if array.ndim == 0:
        return array.reshape(1, 1)
    if array.ndim == 1:
        return array.reshape(-1, 1)
    return array.reshape(array.shape[0], -1)


def _short(values: np.ndarray) -> list[float]:
    """Values rounded to 7 significant digits: a profile must stay small (it travels in KV)."""
    return [float(f"{v:.7g}") for v in values.tolist()]


def _is_categorical(column: np.ndarray) -> bool:
    if column.dtype.kind not in "biu":
        return False
    return len(np.unique(column)) <= MAX_CATEGORIES


def profile_feature(
    tensor: str, index: int, width: int, ndim: int, column: np.ndarray, bins: int = DEFAULT_BINS
) -> FeatureProfile:
    """The reference profile of one column of a sample."""
    name = feature_name(tensor, index, width, ndim)
    n = int(column.shape[0])
    if _is_categorical(column):
        cats, counts = np.unique(column, return_counts=True)
        expected = [round(float(c) / n, 7) for c in counts] + [0.0]
        return FeatureProfile(
            name=name,
            tensor=tensor,
            index=index,
            kind="categorical",
            edges=[float(c) for c in cats],
            expected=expected,
            count=n,
        )
    values = column.astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"feature {name!r}: the sample holds NaN or infinite values")
    probs = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    edges = np.unique(np.asarray(_short(np.quantile(values, probs))))
    counts = np.bincount(np.searchsorted(edges, values, side="right"), minlength=len(edges) + 1)
    return FeatureProfile(
        name=name,
        tensor=tensor,
        index=index,
        kind="continuous",
        edges=[float(e) for e in edges],
        expected=[round(float(c) / n, 7) for c in counts],
        quantiles=_short(np.quantile(values, np.linspace(0.0, 1.0, QUANTILES))),
        count=n,
    )


def build_profile(
    tensors: Mapping[str, np.ndarray], *, model: str = "", bins: int = DEFAULT_BINS
) -> Profile:
    """A profile of every column of every tensor in a sample.

    Args:
        tensors: tensor name → sample with the batch (row) axis first; inputs
            and, when known, outputs of the model on the same rows.
        model: model name recorded in the profile.
        bins: histogram bins per continuous feature (fewer when quantiles tie).

    Raises:
        ValueError: an empty sample, fewer rows than bins, or NaN values.
    """
    if bins < 2:
        raise ValueError("a profile needs at least 2 bins")
    features: list[FeatureProfile] = []
    for tensor, array in tensors.items():
        arr = np.asarray(array)
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"tensor {tensor!r}: only numeric tensors can be profiled")
        rows = as_rows(arr)
        if rows.shape[0] < bins:
            raise ValueError(
                f"tensor {tensor!r}: the sample has {rows.shape[0]} rows; a profile with "
                f"{bins} bins needs at least {bins} (ideally thousands)"
            )
        width = rows.shape[1]
        for i in range(width):
            features.append(profile_feature(tensor, i, width, arr.ndim, rows[:, i], bins))
    if not features:
        raise ValueError("the sample holds no tensors")
    return Profile(model=model, created_unix_ms=time.time_ns() // 1_000_000, features=features)


def live_shares(feature: FeatureProfile, values: np.ndarray) -> np.ndarray:
    """Share of `values` in each of the feature's bins."""
    n = max(len(values), 1)
    if feature.kind == "categorical":
        cats = np.asarray(feature.edges)
        pos = np.searchsorted(cats, values)
        pos_clipped = np.minimum(pos, len(cats) - 1)
        known = cats[pos_clipped] == values
        idx = np.where(known, pos_clipped, len(cats))
    else:
        idx = np.searchsorted(np.asarray(feature.edges), values, side="right")
    return np.bincount(idx, minlength=len(feature.expected)).astype(np.float64) / n


def psi(feature: FeatureProfile, values: np.ndarray) -> float:
    """Population stability index of live `values` against the feature's reference."""
    actual = np.maximum(live_shares(feature, values), EPSILON)
    expected = np.maximum(np.asarray(feature.expected), EPSILON)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def ks(feature: FeatureProfile, values: np.ndarray) -> float | None:
    """KS statistic of live `values` against a continuous feature (None for categorical)."""
    if feature.kind != "continuous" or not feature.quantiles or len(values) == 0:
        return None
    live = np.sort(values)
    points = np.asarray(feature.quantiles)
    ref_cdf = np.linspace(0.0, 1.0, len(points))
    live_cdf = np.searchsorted(live, points, side="right") / len(live)
    return float(np.max(np.abs(live_cdf - ref_cdf)))


class FeatureDrift(BaseModel):
    """Drift of one feature over a window."""

    psi: float
    ks: float | None = None


class DriftReport(BaseModel):
    """Latest drift of one model version (the value kept in the drift KV bucket)."""

    model: str
    version: str
    ts_unix_ms: int
    rows: int
    """Rows in the smallest window the statistics were computed over."""
    features: dict[str, FeatureDrift]

    def worst(self, count: int | None = None) -> list[tuple[str, FeatureDrift]]:
        """Features by descending PSI (then KS)."""
        ranked = sorted(
            self.features.items(), key=lambda kv: (kv[1].psi, kv[1].ks or 0.0), reverse=True
        )
        return ranked if count is None else ranked[:count]


def profiled_columns(profile: Profile) -> dict[str, list[int]]:
    """Tensor name → the sorted column indices the profile describes.

    A live window keeps only these columns, so a wide tensor with a few
    profiled features costs a few columns of memory, not all of them.
    """
    return {t: sorted({f.index for f in fs}) for t, fs in profile.tensors().items()}


def evaluate(
    profile: Profile,
    windows: Mapping[str, np.ndarray],
    columns: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, FeatureDrift]:
    """PSI and KS of every profiled feature whose tensor has a window.

    Args:
        profile: the version's reference.
        windows: tensor name → live rows ``(rows, columns)``.
        columns: tensor name → which tensor column each window column is
            (`profiled_columns`); None when windows hold every column.
    """
    positions = (
        None
        if columns is None
        else {t: {c: i for i, c in enumerate(cols)} for t, cols in columns.items()}
    )
    out: dict[str, FeatureDrift] = {}
    for feature in profile.features:
        rows = windows.get(feature.tensor)
        if rows is None or rows.shape[0] == 0:
            continue
        if positions is None:
            position = feature.index
        else:
            found = positions.get(feature.tensor, {}).get(feature.index)
            if found is None:
                continue
            position = found
        if position >= rows.shape[1]:
            continue
        column = rows[:, position]
        out[feature.name] = FeatureDrift(psi=psi(feature, column), ks=ks(feature, column))
    return out


class SlidingWindow:
    """The last `capacity` rows of one tensor (a ring buffer of float64).

    Args:
        capacity: rows kept; older rows are overwritten.
        width: features per row.
    """

    def __init__(self, capacity: int, width: int) -> None:
        if capacity < 1 or width < 1:
            raise ValueError("a window needs a positive capacity and width")
        self._buf = np.empty((capacity, width), dtype=np.float64)
        self._next = 0
        self._size = 0
        self.added = 0
        """Rows ever added (lets a reader tell whether anything changed)."""

    @property
    def width(self) -> int:
        """Features per row."""
        return int(self._buf.shape[1])

    def __len__(self) -> int:
        return self._size

    def add(self, rows: np.ndarray) -> None:
        """Append rows ``(n, width)``; rows of another width are refused."""
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(
                f"rows of shape {rows.shape} do not fit a window of width {self.width}"
            )
        cap = self._buf.shape[0]
        if rows.shape[0] >= cap:
            self._buf[:] = rows[-cap:]
            self._next, self._size = 0, cap
        else:
            n = rows.shape[0]
            end = self._next + n
            if end <= cap:
                self._buf[self._next : end] = rows
            else:
                first = cap - self._next
                self._buf[self._next :] = rows[:first]
                self._buf[: n - first] = rows[first:]
            self._next = end % cap
            self._size = min(cap, self._size + n)
        self.added += int(rows.shape[0])

    def values(self) -> np.ndarray:
        """The rows held (a copy, in no particular order)."""
        return self._buf[: self._size].copy()
