"""A pushed profile.json must parse and describe tensors and columns the model has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferbus_common.drift import build_profile
from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_registry.profilecheck import MAX_PROFILE_BYTES, check_profile

CONFIG = ModelConfig.model_validate(
    {
        "name": "m",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
    }
)


def _write(tmp_path: Path, tensors: dict[str, np.ndarray]) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(build_profile(tensors).model_dump_json())
    return path


def test_a_matching_profile_of_inputs_and_outputs_is_accepted(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    check_profile(
        _write(tmp_path, {"x": rng.normal(size=(50, 3)), "y": rng.random(size=(50, 2))}),
        CONFIG,
        "m",
    )


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"z": np.zeros((50, 3))}, "does not have"),
        ({"x": np.random.default_rng(1).normal(size=(50, 4))}, "column 3 of 'x'"),
    ],
)
def test_profiles_that_cannot_match_traffic_are_refused(
    tmp_path: Path, tensors: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_profile(_write(tmp_path, tensors), CONFIG, "m")


def test_malformed_and_oversized_profiles_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text('{"features": []}')
    with pytest.raises(InvalidArgument, match="invalid"):
        check_profile(path, CONFIG, "m")
    path.write_bytes(b" " * (MAX_PROFILE_BYTES + 1))
    with pytest.raises(InvalidArgument, match="at most"):
        check_profile(path, CONFIG, "m")
