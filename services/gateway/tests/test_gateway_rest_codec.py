"""KServe V2 REST bodies: JSON tensors and the binary tensor data extension."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_gateway.canonical import InferResponse
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
