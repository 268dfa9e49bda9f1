"""Comparing a shadow reply with the primary's (pure, no bus)."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_router.shadow import Incomparable, compare_replies


def _frame(**arrays: np.ndarray) -> bytes:
    return encode_tensors([tensor_from_numpy(k, v) for k, v in arrays.items()])


def test_classification_agreement_and_max_difference() -> None:
    a = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]], dtype=np.float32)
    b = a.copy()
    b[2] = [0.4, 0.6]  # flips row 2
    b[0] = [0.85, 0.15]
    result = compare_replies(_frame(probabilities=a), _frame(probabilities=b))
    assert (result.rows, result.agree) == (4, 3)
    assert result.max_abs_diff == pytest.approx(0.2, abs=1e-6)


def test_scores_without_classes_give_only_a_difference() -> None:
    a = np.array([[1.0], [2.0]], dtype=np.float64)
    result = compare_replies(_frame(score=a), _frame(score=a + 0.5))
    assert result.rows == 0
    assert result.max_abs_diff == pytest.approx(0.5)


def test_different_outputs_are_incomparable() -> None:
    a = np.zeros((2, 2), dtype=np.float32)
    with pytest.raises(Incomparable, match="shape"):
        compare_replies(_frame(p=a), _frame(p=np.zeros((3, 2), dtype=np.float32)))
    with pytest.raises(Incomparable, match="outputs differ"):
        compare_replies(_frame(p=a), _frame(q=a))
    with pytest.raises(Incomparable, match="undecodable"):
        compare_replies(b"junk", _frame(p=a))
