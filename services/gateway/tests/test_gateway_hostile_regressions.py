"""Hostile REST bodies the fuzzer (tests/fuzz) found answered 500; each is a 400 now."""

from __future__ import annotations

import json

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_gateway.rest.codec import request_from_http


def _body(**item: object) -> bytes:
    base = {"name": "input", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
    return json.dumps({"inputs": [{**base, **item}]}).encode()


@pytest.mark.parametrize(
    "body",
    [
        _body(datatype=[]),  # unhashable datatype
        _body(datatype={"a": 1}),
        _body(datatype="BYTES", shape=[2], data=[["a"], "b", ["c", ["d"]]]),  # ragged
        _body(datatype="INT32", data=[2**70, 1]),  # overflows the dtype
        _body(datatype="INT8", data=[1000, 1]),
        json.dumps(
            {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [1], "data": [1.0]}],
                "outputs": 5,
            }
        ).encode(),
    ],
)
def test_hostile_body_is_invalid_argument(body: bytes) -> None:
    with pytest.raises(InvalidArgument):
        request_from_http("m", "", body, None, None)
