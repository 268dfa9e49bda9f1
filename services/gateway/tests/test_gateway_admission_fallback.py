"""Fixed fallback answers built from a model's ``fallback`` config."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from inferbus_common.codec import deserialize_bytes
from inferbus_common.modelconfig import FallbackConfig, ModelConfig
from inferbus_gateway.admission.fallback import fallback_outputs


def config(**fallback: object) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "fraud",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "score", "datatype": "FP32", "shape": [-1, 2]},
                {"name": "label", "datatype": "BYTES", "shape": [-1, 1]},
            ],
            "fallback": fallback or None,
        }
    )


def test_fixed_outputs_are_repeated_per_row() -> None:
    cfg = config(outputs={"score": [0.5, 0.5], "label": ["unknown"]})
    out = fallback_outputs(cfg, 3)
    assert out is not None
    score, label = out
    assert score.shape == (3, 2)
    np.testing.assert_array_equal(score.as_numpy(), np.full((3, 2), 0.5, dtype=np.float32))
    assert label.shape == (3, 1)
    assert deserialize_bytes(label.data) == [b"unknown"] * 3
    only = fallback_outputs(cfg, 1, ["label"])
    assert only is not None and [t.name for t in only] == ["label"]


def test_no_answer_when_not_covered() -> None:
    assert fallback_outputs(config(), 2) is None
    partial = config(outputs={"score": [0.1, 0.9]})
    assert fallback_outputs(partial, 2) is None
    assert fallback_outputs(partial, 2, ["score"]) is not None
    assert fallback_outputs(config(model="fraud-lite", version="1.0.0"), 2) is None
    bad_len = config(outputs={"score": [1.0, 2.0, 3.0], "label": ["x"]})
    assert fallback_outputs(bad_len, 1) is None


def test_fallback_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        FallbackConfig()
    with pytest.raises(ValidationError, match="exactly one"):
        FallbackConfig(outputs={"a": [1]}, model="b")
    with pytest.raises(ValidationError, match="needs 'model'"):
        FallbackConfig(outputs={"a": [1]}, version="1")
    with pytest.raises(ValidationError, match="not outputs of the model"):
        config(outputs={"nope": [1]})
    assert config().fallback is None
