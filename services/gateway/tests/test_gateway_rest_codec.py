"""KServe V2 REST bodies: JSON tensors and the binary tensor data extension."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_gateway.canonical import InferResponse, ShmRef
from inferbus_gateway.rest.codec import request_from_http, response_to_http


def test_json_nested_data() -> None:
    body = json.dumps(
        {
            "id": "r1",
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
            "parameters": {"timeout": 1_000_000},
        }
    ).encode()
    req, binary, binary_all = request_from_http("m", "", body, None, None)
    assert req.inputs[0].as_numpy().tolist() == [[1, 2], [3, 4]]
    assert req.outputs == ["y"] and binary == {"y"} and not binary_all
    assert req.timeout_s == pytest.approx(1.0) and req.id == "r1"


def test_binary_extension_round_trip() -> None:
    x = np.arange(8, dtype=np.int64).reshape(2, 4)
    s = [b"hello", b"w"]
    from inferbus_common.codec import serialize_bytes

    sb = serialize_bytes(s)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "INT64",
                    "shape": [2, 4],
                    "parameters": {"binary_data_size": x.nbytes},
                },
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(sb)},
                },
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    req, _, binary_all = request_from_http("m", "1", head + x.tobytes() + sb, len(head), None)
    assert np.array_equal(req.inputs[0].as_numpy(), x)
    assert req.inputs[1].as_numpy().tolist() == s
    assert binary_all


@pytest.mark.parametrize(
    ("doc", "extra", "message"),
    [
        ({"inputs": []}, b"", "non-empty 'inputs'"),
        (
            {"inputs": [{"name": "x", "datatype": "F", "shape": [1], "data": [1]}]},
            b"",
            "unknown datatype",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1]}]},
            b"",
            "needs 3",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]},
            b"",
            "non-negative",
        ),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, b"", "neither 'data'"),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [2],
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            },
            b"1234",
            "does not fit",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [2],
                        "parameters": {"binary_data_size": 4},
                    }
                ]
            },
            b"1234",
            "needs 8 bytes",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [1],
                        "parameters": {"binary_data_size": 4},
                    }
                ]
            },
            b"12345678",
            "not claimed",
        ),
    ],
)
def test_malformed_bodies(doc: dict, extra: bytes, message: str) -> None:
    head = json.dumps(doc).encode()
    with pytest.raises(InvalidArgument, match=message):
        request_from_http("m", "", head + extra, len(head) if extra else None, None)


def test_not_json() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        request_from_http("m", "", b"{nope", None, None)


def test_response_json_and_binary() -> None:
    y = np.array([[0.5, 0.5]], dtype=np.float32)
    resp = InferResponse("m", "1", "r", [tensor_from_numpy("y", y)], {})
    body, n = response_to_http(resp, set(), False)
    assert n is None and json.loads(body)["outputs"][0]["data"] == [0.5, 0.5]
    body, n = response_to_http(resp, {"y"}, False)
    assert n is not None
    head = json.loads(body[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert np.frombuffer(body[n:], dtype=np.float32).tolist() == [0.5, 0.5]


def _one_input(datatype: str, data: object, shape: list[int], **extra: object) -> bytes:
    item = {"name": "x", "datatype": datatype, "shape": shape, "data": data}
    return json.dumps({"inputs": [item], **extra}).encode()


@pytest.mark.parametrize(
    ("datatype", "data", "what"),
    [
        ("FP32", ["NaN", 1.0], "JSON numbers, got 'NaN'"),
        ("FP32", [True, 1.0], "JSON numbers, got True"),
        ("FP64", [[1.0], ["2"]], "JSON numbers"),
        ("INT32", [1, 2.5], "JSON integers, got 2.5"),
        ("INT64", [1, False], "JSON integers, got False"),
        ("UINT8", [1, None], "JSON integers, got None"),
        ("BOOL", [True, 1], "JSON true/false, got 1"),
    ],
)
def test_numeric_json_data_is_strict(datatype: str, data: list, what: str) -> None:
    """Triton's rules: no strings or booleans for numbers, no floats for integers."""
    body = _one_input(datatype, data, [2, 1] if isinstance(data[0], list) else [2])
    with pytest.raises(InvalidArgument, match=what):
        request_from_http("m", "", body, None, None)


@pytest.mark.parametrize(
    ("datatype", "data"),
    [("INT8", [1, 300]), ("UINT16", [1, -1]), ("FP32", [1.0, 1e39]), ("FP16", [1.0, 70000])],
)
def test_numbers_out_of_range_are_refused(datatype: str, data: list) -> None:
    with pytest.raises(InvalidArgument, match=f"not a list of {datatype}"):
        request_from_http("m", "", _one_input(datatype, data, [2]), None, None)


def test_integers_are_numbers_for_floating_point() -> None:
    req, _, _ = request_from_http("m", "", _one_input("FP32", [1, 2.5], [2]), None, None)
    assert req.inputs[0].as_numpy().tolist() == [1.0, 2.5]


def test_data_and_binary_data_in_one_input_are_refused() -> None:
    item = {
        "name": "x",
        "datatype": "FP32",
        "shape": [1],
        "data": [1.0],
        "parameters": {"binary_data_size": 4},
    }
    head = json.dumps({"inputs": [item]}).encode()
    with pytest.raises(InvalidArgument, match=r"either 'data' or parameters\.binary_data_size"):
        request_from_http("m", "", head + np.float32(2).tobytes(), len(head), None)


@pytest.mark.parametrize("value", ["1000", 1.5, True, -5, None, [1]])
@pytest.mark.parametrize("key", ["timeout", "priority"])
def test_timeout_and_priority_must_be_integers(key: str, value: object) -> None:
    body = _one_input("FP32", [1.0], [1], parameters={key: value})
    with pytest.raises(InvalidArgument, match=f"parameters.{key} must be a non-negative integer"):
        request_from_http("m", "", body, None, None)


def test_zero_timeout_means_none() -> None:
    body = _one_input("FP32", [1.0], [1], parameters={"timeout": 0, "priority": 2})
    req, _, _ = request_from_http("m", "", body, None, 3.0)
    assert req.timeout_s == 3.0 and req.priority == 2


def test_rest_sequence_and_shared_memory_parameters() -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "INT32",
                    "shape": [1, 16],
                    "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 64},
                }
            ],
            "outputs": [
                {
                    "name": "y",
                    "parameters": {
                        "shared_memory_region": "out",
                        "shared_memory_byte_size": 64,
                    },
                }
            ],
            "parameters": {"sequence_id": "s-1", "sequence_start": True, "sequence_end": False},
        }
    )
    req, binary, _ = request_from_http("m", "", body, None, None)
    assert binary == set()
    assert req.sequence is not None and (req.sequence.id, req.sequence.start) == ("s-1", True)
    assert req.shm_inputs["x"].region == "in" and req.shm_outputs["y"].region == "out"
    bad = orjson.loads(body)
    bad["parameters"]["sequence_start"] = "yes"
    with pytest.raises(InvalidArgument, match="must be a bool"):
        request_from_http("m", "", orjson.dumps(bad), None, None)


@pytest.mark.parametrize(("key", "value"), [("binary_data", True), ("classification", 2)])
def test_rest_shared_memory_output_refuses_binary_data_or_classification_like_triton(
    key: str, value: object
) -> None:
    body = {
        "inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1]}],
        "outputs": [
            {
                "name": "y",
                "parameters": {
                    "shared_memory_region": "out",
                    "shared_memory_byte_size": 4,
                    key: value,
                },
            }
        ],
    }
    with pytest.raises(InvalidArgument, match=f"both 'shared_memory_region' and '{key}'"):
        request_from_http("m", "", orjson.dumps(body), None, None)


def test_rest_shared_memory_output_is_answered_without_parameters_or_data() -> None:
    resp = InferResponse(
        model="m",
        version="1",
        id="r",
        outputs=[Tensor("y", "INT32", (1,), b""), Tensor("z", "INT32", (1,), b"\x01\0\0\0")],
        shm_outputs={"y": ShmRef("out", 4)},
    )
    body, header_length = response_to_http(resp, {"z"}, False)
    assert header_length is not None
    y, z = orjson.loads(body[:header_length])["outputs"]
    # Triton's C++ client requires binary_data_size in any output's parameters.
    assert y == {"name": "y", "datatype": "INT32", "shape": [1]}
    assert z["parameters"] == {"binary_data_size": 4}
    assert body[header_length:] == b"\x01\0\0\0"
