"""config.json sections of stateful (sequence_batching) and decoupled models."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from inferbus_common.modelconfig import ModelConfig


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "name": "seq",
        "max_batch_size": 8,
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
        "outputs": [{"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]}],
        **extra,
    }


SEQUENCE = {
    "controls": [
        {"kind": "start", "name": "START"},
        {"kind": "corrid", "name": "CORRID", "datatype": "UINT64"},
    ],
    "states": [{"input": "S_IN", "output": "S_OUT", "datatype": "FP32", "shape": [2, 3]}],
}


def test_engine_view_adds_controls_and_states_with_the_batch_axis() -> None:
    config = ModelConfig.model_validate(_config(sequence_batching=SEQUENCE))
    view = config.engine_view()
    assert [(s.name, s.datatype, s.shape) for s in view.inputs] == [
        ("INPUT", "INT32", [-1, 1]),
        ("START", "INT32", [-1, 1]),
        ("CORRID", "UINT64", [-1, 1]),
        ("S_IN", "FP32", [-1, 2, 3]),
    ]
    assert [(s.name, s.shape) for s in view.outputs] == [("OUTPUT", [-1, 1]), ("S_OUT", [-1, 2, 3])]
    assert view.sequence_batching is None
    # Clients still see only their own tensors.
    assert [s.name for s in config.inputs] == ["INPUT"]


def test_engine_view_without_a_batch_axis() -> None:
    doc = _config(sequence_batching=SEQUENCE, max_batch_size=0)
    doc["inputs"][0]["shape"] = [1]
    doc["outputs"][0]["shape"] = [1]
    view = ModelConfig.model_validate(doc).engine_view()
    assert [s.shape for s in view.inputs] == [[1], [1], [1], [2, 3]]


def test_sections_are_left_out_of_dumps_when_absent() -> None:
    dumped = ModelConfig.model_validate(_config()).model_dump()
    assert "sequence_batching" not in dumped and "decoupled" not in dumped
    assert (
        ModelConfig.model_validate(_config(sequence_batching=SEQUENCE)).model_dump()[
            "sequence_batching"
        ]["max_sequence_idle_us"]
        == 1_000_000
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"controls": [{"kind": "start", "name": "S", "datatype": "UINT64"}]}, "must be one of"),
        ({"controls": [{"kind": "corrid", "name": "C", "datatype": "FP32"}]}, "must be one of"),
        (
            {"controls": [{"kind": "start", "name": "A"}, {"kind": "start", "name": "B"}]},
            "each kind at most once",
        ),
        ({"controls": [{"kind": "start", "name": "INPUT"}]}, "also model inputs"),
        ({"controls": [{"kind": "ready", "name": "R", "false_true": [0]}]}, "two values"),
        (
            {"states": [{"input": "A", "output": "B", "datatype": "BYTES", "shape": [1]}]},
            "numeric or BOOL",
        ),
        (
            {"states": [{"input": "A", "output": "B", "datatype": "FP32", "shape": [-1]}]},
            "fixed, positive",
        ),
        (
            {
                "controls": [{"kind": "start", "name": "A"}],
                "states": [{"input": "A", "output": "B", "datatype": "FP32", "shape": [1]}],
            },
            "must be unique",
        ),
        ({"max_sequence_idle_us": 10}, "greater than or equal"),
    ],
)
def test_bad_sequence_sections_are_refused(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig.model_validate(_config(sequence_batching=section))


def test_a_sequence_model_takes_no_fallback_and_no_processing() -> None:
    with pytest.raises(ValidationError, match="fallback"):
        ModelConfig.model_validate(
            _config(sequence_batching={}, fallback={"outputs": {"OUTPUT": [0]}})
        )


def test_decoupled_axis_must_exist_in_every_output() -> None:
    config = ModelConfig.model_validate(_config(decoupled={"axis": 1}))
    assert config.is_decoupled and config.decoupled is not None
    with pytest.raises(ValidationError, match="not an axis"):
        ModelConfig.model_validate(_config(decoupled={"axis": 2}))
    with pytest.raises(ValidationError, match="both decoupled and a sequence"):
        ModelConfig.model_validate(_config(decoupled={}, sequence_batching={}))
