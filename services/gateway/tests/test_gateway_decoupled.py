"""Splitting a decoupled model's answer into its responses."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import Internal
from inferbus_common.modelconfig import DecoupledConfig
from inferbus_gateway.canonical import InferResponse
from inferbus_gateway.triton.decoupled import split_responses


def _answer(**outputs: np.ndarray) -> InferResponse:
    return InferResponse(
        model="rep",
        version="1",
        id="r1",
        outputs=[tensor_from_numpy(name, arr) for name, arr in outputs.items()],
        timings_ms={"total": 1.0},
    )


def test_one_response_per_index_keeping_the_axis() -> None:
    answer = _answer(OUT=np.array([100, 101, 102], np.int32), IDX=np.arange(3, dtype=np.uint32))
    parts = split_responses(DecoupledConfig(), answer)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        assert (part.id, part.model, part.version) == ("r1", "rep", "1")
        out, idx = part.outputs
        assert (out.shape, out.as_numpy().tolist()) == ((1,), [100 + i])
        assert (idx.datatype, idx.as_numpy().tolist()) == ("UINT32", [i])


def test_dropping_the_axis_and_another_axis() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    parts = split_responses(DecoupledConfig(axis=1, keep_axis=False), _answer(Y=arr))
    assert len(parts) == 3
    assert parts[1].outputs[0].shape == (2, 2)
    assert np.array_equal(parts[1].outputs[0].as_numpy(), arr[:, 1, :])


def test_strings_split_too() -> None:
    words = np.array([b"a", b"bc", b"def"], dtype=object)
    parts = split_responses(DecoupledConfig(), _answer(W=words))
    assert [p.outputs[0].as_numpy().tolist() for p in parts] == [[b"a"], [b"bc"], [b"def"]]


def test_an_empty_axis_means_no_response() -> None:
    assert split_responses(DecoupledConfig(), _answer(OUT=np.zeros(0, np.int32))) == []


def test_outputs_that_disagree_are_the_models_fault() -> None:
    with pytest.raises(Internal, match="different lengths"):
        split_responses(
            DecoupledConfig(), _answer(A=np.zeros(2, np.int32), B=np.zeros(3, np.int32))
        )
    with pytest.raises(Internal, match="no responses axis"):
        split_responses(DecoupledConfig(axis=1), _answer(A=np.zeros(2, np.int32)))
