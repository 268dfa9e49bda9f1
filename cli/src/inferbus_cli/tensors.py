"""Inputs for ``inferbus infer``: parsing ``NAME=...`` arguments, random rows,
building the KServe V2 request and turning the response into JSON.

Tensors go on the wire as ``raw_input_contents`` (little-endian bytes, V2
BYTES serialisation), using the shared codec in ``inferbus_common``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.codec import numpy_to_raw, raw_to_numpy
from inferbus_common.datatypes import BYTES, numpy_dtype
from inferbus_common.errors import InvalidArgument
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb


@dataclass(frozen=True, slots=True)
class InputArg:
    """One ``--input`` argument.

    Attributes:
        name: the model input it fills.
        value: a parsed JSON value (nested lists) or, for ``@file.npy``, an array.
    """

    name: str
    value: Any


def parse_input_arg(text: str) -> InputArg:
    """Parse ``NAME=JSON`` or ``NAME=@file.npy``.

    Raises:
        ValueError: the text has no ``=``, the JSON does not parse or the file
            cannot be read as a ``.npy`` array.
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--input {text!r}: expected NAME=JSON or NAME=@file.npy")
    if rest.startswith("@"):
        path = Path(rest[1:]).expanduser()
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--input {name}: cannot read {path} as a .npy array: {exc}") from exc
        if not isinstance(array, np.ndarray):
            raise ValueError(f"--input {name}: {path} holds several arrays; give a .npy file")
        return InputArg(name, array)
    try:
        value = json.loads(rest)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--input {name}: not valid JSON ({exc.msg} at char {exc.pos})") from exc
    return InputArg(name, value)


def to_array(value: Any, datatype: str) -> np.ndarray:
    """Convert a JSON value or an array to an array of the model's `datatype`.

    ``.npy`` arrays already of a fixed-size dtype are cast only when it differs.

    Raises:
        ValueError: the value cannot be represented in `datatype`.
    """
    if datatype == BYTES:
        array = np.asarray(value, dtype=object)
        return array
    dtype = numpy_dtype(datatype)
    try:
        array = np.asarray(value)
        if array.dtype == object:
            raise ValueError("ragged or mixed nesting")
        return array.astype(dtype, copy=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot convert the value to {datatype}: {exc}") from exc


def concrete_shape(shape: Sequence[int], rows: int) -> tuple[int, ...]:
    """A metadata shape with its dynamic dimensions filled in.

    The first ``-1`` (the batch axis) becomes `rows`; any other ``-1`` becomes 1.
    """
    out = []
    for i, dim in enumerate(shape):
        if dim == -1:
            out.append(rows if i == 0 else 1)
        else:
            out.append(int(dim))
    return tuple(out)


def random_array(
    datatype: str, shape: Sequence[int], rows: int, rng: np.random.Generator
) -> np.ndarray:
    """Random data for one input: `rows` rows of the metadata `shape`."""
    dims = concrete_shape(shape, rows)
    if datatype == BYTES:
        words = rng.integers(0, 1_000_000, size=dims)
        out = np.empty(dims, dtype=object)
        out.reshape(-1)[:] = [f"w{int(w)}".encode() for w in words.reshape(-1)]
        return out
    dtype = numpy_dtype(datatype)
    if dtype.kind == "f":
        return rng.standard_normal(dims).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=dims).astype(dtype)
    high = min(100, int(np.iinfo(dtype).max))
    return rng.integers(0, high, size=dims).astype(dtype)


def build_request(
    model: str,
    version: str,
    arrays: Sequence[tuple[str, np.ndarray]],
    *,
    request_id: str = "",
) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying every tensor in ``raw_input_contents``."""
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in arrays:
        datatype, shape, raw = numpy_to_raw(array)
        request.inputs.append(
            pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape)
        )
        request.raw_input_contents.append(bytes(raw))
    return request


def parameter_value(param: pb.InferParameter) -> Any:
    """The Python value of an InferParameter (None when unset)."""
    which = param.WhichOneof("parameter_choice")
    return getattr(param, which) if which else None


_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP16": "fp32_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype == object:
        flat = [
            v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
            for v in array.reshape(-1)
        ]
        return np.array(flat, dtype=object).reshape(array.shape).tolist()
    return array.tolist()


def output_arrays(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Every output of a response as an array (raw or typed contents).

    Raises:
        InvalidArgument: the raw data does not match an output's shape.
    """
    out: dict[str, np.ndarray] = {}
    raw = list(response.raw_output_contents)
    for i, tensor in enumerate(response.outputs):
        shape = tuple(tensor.shape)
        if raw:
            out[tensor.name] = raw_to_numpy(raw[i], tensor.datatype, shape)
            continue
        values = list(getattr(tensor.contents, _CONTENTS_FIELD.get(tensor.datatype, "")))
        if tensor.datatype == BYTES:
            array = np.empty(len(values), dtype=object)
            array[:] = values
        else:
            array = np.asarray(values, dtype=numpy_dtype(tensor.datatype))
        out[tensor.name] = array.reshape(shape)
    return out


def response_to_json(response: pb.ModelInferResponse) -> dict[str, Any]:
    """The response as a JSON-ready dict: outputs with data, plus any parameters."""
    outputs = {}
    for tensor, (name, array) in zip(
        response.outputs, output_arrays(response).items(), strict=True
    ):
        outputs[name] = {
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
            "data": _jsonable(array),
        }
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "outputs": outputs,
    }
    params = {k: parameter_value(v) for k, v in response.parameters.items()}
    if params:
        doc["parameters"] = params
    return doc


def check_datatype_known(datatype: str) -> None:
    """Raise ValueError for a datatype the CLI cannot build data for."""
    if datatype == BYTES:
        return
    try:
        numpy_dtype(datatype)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from exc
