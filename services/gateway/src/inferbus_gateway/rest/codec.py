"""KServe V2 REST bodies ↔ canonical request/response.

Supports JSON tensors (nested or flat ``data``) and the binary tensor data
extension: a JSON header of ``Inference-Header-Content-Length`` bytes followed
by raw tensor bytes for every input whose ``parameters.binary_data_size`` is
set; outputs are returned binary when asked (``parameters.binary_data`` on an
output, or ``binary_data_output`` on the request).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from inferbus_common.codec import (
    Tensor,
    check_raw_size,
    deserialize_bytes,
    element_count,
    serialize_bytes,
)
from inferbus_common.datatypes import ALL_DATATYPES, BYTES, numpy_dtype
from inferbus_common.errors import InvalidArgument
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.triton.classification import class_count
from inferbus_gateway.triton.sequences import sequence_flags
from inferbus_gateway.triton.sharedmemory import shm_ref

HEADER_LENGTH = "inference-header-content-length"


_JSON_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    **{t: ((int, float), "numbers") for t in ("FP16", "FP32", "FP64")},
    **{
        t: ((int,), "integers")
        for t in ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
    },
    "BOOL": ((bool,), "true/false"),
}
"""Numeric datatype → the JSON value types its ``data`` may hold, and their name.

Triton's rules: a JSON number for floating point (no ``"NaN"`` strings, no
``true``), an integer for integer types, ``true``/``false`` for BOOL. Checked
by exact type, so ``true`` (a Python bool, a subclass of int) is no number."""


def _check_json_values(name: str, datatype: str, data: Any) -> None:
    """Refuse ``data`` elements of the wrong JSON type for a numeric datatype."""
    allowed, what = _JSON_KINDS[datatype]
    stack = [data]
    while stack:
        item = stack.pop()
        if type(item) is list:
            stack.extend(item)
        elif type(item) not in allowed:
            shown = repr(item)
            raise InvalidArgument(
                f"input '{name}': {datatype} data must be JSON {what}, got "
                f"{shown if len(shown) <= 40 else shown[:37] + '...'}"
            )


def _json_data_to_raw(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> bytes:
    count = element_count(shape)
    if datatype == BYTES:
        try:
            flat = np.asarray(data, dtype=object).reshape(-1)
            if flat.size != count:
                raise InvalidArgument(
                    f"input '{name}': {flat.size} values in data but shape {list(shape)} "
                    f"needs {count}"
                )
            return serialize_bytes(flat)
        except (ValueError, TypeError, OverflowError) as exc:
            # Ragged lists, or elements that are neither strings nor bytes.
            raise InvalidArgument(f"input '{name}': data is not a list of BYTES: {exc}") from None
    _check_json_values(name, datatype, data)
    try:
        with np.errstate(over="raise", invalid="raise"):
            arr = np.asarray(data, dtype=numpy_dtype(datatype))
    except (ValueError, TypeError, OverflowError, FloatingPointError) as exc:
        raise InvalidArgument(f"input '{name}': data is not a list of {datatype}: {exc}") from None
    if arr.size != count:
        raise InvalidArgument(
            f"input '{name}': {arr.size} values in data but shape {list(shape)} needs {count}"
        )
    return arr.tobytes()


def _int_parameter(params: dict[str, Any], key: str) -> int:
    """A request parameter that must be a non-negative JSON integer (0 when absent).

    Raises:
        InvalidArgument: it is there but not such an integer.
    """
    value = params.get(key, 0)
    if type(value) is not int or value < 0:
        raise InvalidArgument(
            f"parameters.{key} must be a non-negative integer"
            + (" (microseconds)" if key == "timeout" else "")
            + f", got {value!r}"
        )
    return value


def request_from_http(
    model: str, version: str, body: bytes, header_length: int | None, timeout_s: float | None
) -> tuple[InferRequest, set[str], bool]:
    """Parse a V2 REST infer body.

    Returns:
        The canonical request, the names of outputs wanted in binary, and
        whether every output is wanted in binary.

    Raises:
        InvalidArgument: malformed JSON, bad binary sizes, unknown datatype...
    """
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise InvalidArgument(
                f"Inference-Header-Content-Length {header_length} is outside the body "
                f"({len(body)} bytes)"
            )
        head, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        head, binary = body, memoryview(b"")
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("request body must be a JSON object")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("request must have a non-empty 'inputs' list")
    offset = 0
    tensors = []
    shm_inputs = {}
    for item in inputs:
        if not isinstance(item, dict):
            raise InvalidArgument("each input must be a JSON object")
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not name:
            raise InvalidArgument("every input needs a 'name'")
        if not isinstance(datatype, str) or datatype not in ALL_DATATYPES:
            raise InvalidArgument(
                f"input '{name}': unknown datatype {datatype!r}; expected one of "
                f"{sorted(ALL_DATATYPES)}"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise InvalidArgument(f"input '{name}': shape must be a list of non-negative ints")
        shape_t = tuple(shape)
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument(f"input '{name}': 'parameters' must be a JSON object")
        size = params.get("binary_data_size")
        ref = shm_ref(params, f"input '{name}'")
        if ref is not None:
            if "data" in item or size is not None:
                raise InvalidArgument(
                    f"input '{name}': its data is in shared memory; send no data for it"
                )
            shm_inputs[name] = ref
            data: bytes | memoryview = b""
        elif size is not None:
            if "data" in item:
                raise InvalidArgument(
                    f"input '{name}': give either 'data' or parameters.binary_data_size, not both"
                )
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidArgument(
                    f"input '{name}': binary_data_size {size} does not fit the "
                    f"{len(binary)} bytes of binary data after the JSON header"
                )
            data = binary[offset : offset + size]
            offset += size
            check_raw_size(name, datatype, shape_t, data)
        else:
            if "data" not in item:
                raise InvalidArgument(f"input '{name}' has neither 'data' nor binary_data_size")
            data = _json_data_to_raw(name, datatype, shape_t, item["data"])
        tensors.append(Tensor(name, datatype, shape_t, data))
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary data are not claimed by any input"
        )
    req_params = doc.get("parameters") or {}
    if not isinstance(req_params, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    binary_all = bool(req_params.get("binary_data_output", False))
    outputs, binary_outputs = [], set()
    classification: dict[str, int] = {}
    shm_outputs = {}
    requested = doc.get("outputs") or []
    if not isinstance(requested, list):
        raise InvalidArgument("'outputs' must be a list of objects with a 'name'")
    for out in requested:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise InvalidArgument("each requested output must be an object with a 'name'")
        outputs.append(out["name"])
        op = out.get("parameters") or {}
        if not isinstance(op, dict):
            raise InvalidArgument(f"output '{out['name']}': 'parameters' must be a JSON object")
        if op.get("binary_data"):
            binary_outputs.add(out["name"])
        if "classification" in op:
            classification[out["name"]] = class_count(op["classification"], out["name"])
        ref = shm_ref(op, f"output '{out['name']}'")
        if ref is not None:
            # Triton's checks and wording: an output in shared memory is neither
            # sent after the JSON nor replaced by its top classes.
            for other in ("binary_data", "classification"):
                if op.get(other):
                    raise InvalidArgument(
                        f"Output can't set both 'shared_memory_region' and '{other}'"
                    )
            shm_outputs[out["name"]] = ref
    priority = _int_parameter(req_params, "priority")
    timeout_param = _int_parameter(req_params, "timeout")
    if timeout_param > 0:
        t = timeout_param / 1e6  # Triton: microseconds
        timeout_s = t if timeout_s is None else min(t, timeout_s)
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    req = InferRequest(
        model=model,
        version=version,
        id=request_id,
        inputs=tensors,
        outputs=outputs,
        priority=priority,
        timeout_s=timeout_s,
        classification=classification,
        sequence=sequence_flags(req_params),
        shm_inputs=shm_inputs,
        shm_outputs=shm_outputs,
    )
    return req, binary_outputs, binary_all


def _json_data(t: Tensor) -> list[Any]:
    if t.datatype == BYTES:
        items = deserialize_bytes(t.data)
        try:
            return [b.decode("utf-8") for b in items]
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"output '{t.name}' holds non-UTF-8 bytes; request it with binary_data"
            ) from None
    return np.frombuffer(t.data, dtype=numpy_dtype(t.datatype)).tolist()


def response_to_http(
    resp: InferResponse, binary_outputs: set[str], binary_all: bool
) -> tuple[bytes, int | None]:
    """Encode a V2 REST response.

    Returns:
        The body and, when binary data follows the JSON, the JSON header length.
    """
    outs = []
    blobs: list[bytes | bytearray | memoryview] = []
    for t in resp.outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        # An output in shared memory gets name, datatype and shape only, as from
        # Triton: no parameters either, since Triton's C++ client reads any
        # output's parameters for binary_data_size and fails when they lack it.
        if t.name in resp.shm_outputs:
            pass
        elif binary_all or t.name in binary_outputs:
            entry["parameters"] = {"binary_data_size": t.nbytes}
            blobs.append(t.data)
        else:
            entry["data"] = _json_data(t)
        outs.append(entry)
    doc: dict[str, Any] = {
        "model_name": resp.model,
        "model_version": resp.version,
        "id": resp.id,
        "outputs": outs,
    }
    params: dict[str, Any] = {}
    if resp.digest:
        params["inferbus_digest"] = resp.digest
    if resp.degraded:
        params["inferbus_degraded"] = resp.degraded
    if params:
        doc["parameters"] = params
    head = orjson.dumps(doc)
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
