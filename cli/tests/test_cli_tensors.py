"""Input parsing (``NAME=[[...]]``, ``@file.npy``), random rows, request and response."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inferbus_cli.tensors import (
    build_request,
    concrete_shape,
    parse_input_arg,
    random_array,
    response_to_json,
    to_array,
)
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb


def test_parse_json_input() -> None:
    arg = parse_input_arg("input=[[1, 2.5], [3, 4]]")
    assert arg.name == "input"
    assert arg.value == [[1, 2.5], [3, 4]]
    array = to_array(arg.value, "FP32")
    assert array.dtype == np.float32 and array.shape == (2, 2)


def test_parse_value_with_equals_sign() -> None:
    arg = parse_input_arg('text=["a=b"]')
    assert arg.name == "text" and arg.value == ["a=b"]
    array = to_array(arg.value, "BYTES")
    assert array.dtype == object and array.tolist() == ["a=b"]


def test_parse_npy_input(tmp_path: Path) -> None:
    data = np.arange(12, dtype=np.int64).reshape(3, 4)
    np.save(tmp_path / "x.npy", data)
    arg = parse_input_arg(f"ids=@{tmp_path / 'x.npy'}")
    assert arg.name == "ids"
    np.testing.assert_array_equal(arg.value, data)
    assert to_array(arg.value, "INT64").dtype == np.int64
    assert to_array(arg.value, "FP32").dtype == np.float32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("input", "expected NAME=JSON"),
        ("=[1]", "expected NAME=JSON"),
        ("input=[[1,", "not valid JSON"),
        ("input=@/nonexistent/x.npy", "cannot read"),
    ],
)
def test_bad_inputs(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_input_arg(text)


def test_ragged_json_is_refused() -> None:
    with pytest.raises(ValueError, match="FP32"):
        to_array([[1, 2], [3]], "FP32")


def test_random_rows_follow_the_metadata() -> None:
    rng = np.random.default_rng(0)
    assert concrete_shape([-1, 64], 3) == (3, 64)
    assert concrete_shape([-1, -1, 2], 5) == (5, 1, 2)
    fp = random_array("FP32", [-1, 64], 3, rng)
    assert fp.shape == (3, 64) and fp.dtype == np.float32
    ints = random_array("INT32", [-1, 4], 2, rng)
    assert ints.dtype == np.int32 and ints.min() >= 0
    flags = random_array("BOOL", [-1], 4, rng)
    assert flags.dtype == np.bool_
    words = random_array("BYTES", [-1, 2], 2, rng)
    assert words.shape == (2, 2) and isinstance(words[0, 0], bytes)


def test_build_request_uses_raw_contents() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([b"x", b"yz"], dtype=object)
    req = build_request("fraud", "1", [("a", a), ("b", b)], request_id="r1")
    assert (req.model_name, req.model_version, req.id) == ("fraud", "1", "r1")
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [
        ("a", "FP32", [2, 3]),
        ("b", "BYTES", [2]),
    ]
    assert req.raw_input_contents[0] == a.tobytes()
    assert req.raw_input_contents[1] == b"\x01\x00\x00\x00x\x02\x00\x00\x00yz"
    assert not req.inputs[0].HasField("contents")


def test_response_to_json_raw_and_typed() -> None:
    probs = np.array([[0.25, 0.75]], dtype=np.float32)
    raw = pb.ModelInferResponse(model_name="fraud", model_version="1", id="r")
    raw.outputs.add(name="probabilities", datatype="FP32", shape=[1, 2])
    raw.raw_output_contents.append(probs.tobytes())
    raw.parameters["inferbus_compute_us"].int64_param = 42
    doc = response_to_json(raw)
    assert doc["outputs"]["probabilities"] == {
        "datatype": "FP32",
        "shape": [1, 2],
        "data": [[0.25, 0.75]],
    }
    assert doc["parameters"] == {"inferbus_compute_us": 42}

    typed = pb.ModelInferResponse(model_name="m")
    out = typed.outputs.add(name="label", datatype="BYTES", shape=[2])
    out.contents.bytes_contents.extend([b"ok", b"fraud"])
    out2 = typed.outputs.add(name="n", datatype="INT64", shape=[2])
    out2.contents.int64_contents.extend([1, 2])
    doc = response_to_json(typed)
    assert doc["outputs"]["label"]["data"] == ["ok", "fraud"]
    assert doc["outputs"]["n"]["data"] == [1, 2]
    assert "parameters" not in doc


def test_readable_json_is_the_same_document() -> None:
    from inferbus_cli.commands.infer import readable_json

    doc = {
        "model_name": "fraud",
        "outputs": {
            "p": {"datatype": "FP32", "shape": [2, 2], "data": [[0.1, 0.9], [0.5, 0.5]]},
            "label": {"datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
        },
        "parameters": {"inferbus_compute_us": 3},
        "inputs": {"input": {"shape": [1, 2], "data": [[1.0, 2.0]]}},
    }
    text = readable_json(doc)
    assert json.loads(text) == doc
    assert "[0.1, 0.9]" in text  # one line per row
