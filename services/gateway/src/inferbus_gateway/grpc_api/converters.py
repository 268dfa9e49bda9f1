"""KServe V2 protobuf messages ↔ canonical request/response.

Raw contents are passed through as bytes (no copy beyond protobuf's own);
typed contents go through a table from datatype to `InferTensorContents`
field, never an if/elif chain.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from inferbus_common.codec import Tensor, element_count, serialize_bytes
from inferbus_common.datatypes import ALL_DATATYPES, BYTES, numpy_dtype
from inferbus_common.errors import InvalidArgument
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.triton.classification import class_count
from inferbus_gateway.triton.sequences import sequence_flags
from inferbus_gateway.triton.sharedmemory import shm_ref
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

#: V2 datatype → the `InferTensorContents` field that carries it (FP16 has none).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _param_value(p: pb.InferParameter) -> object:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def parameter_values(params: Mapping[str, pb.InferParameter]) -> dict[str, object]:
    """A protobuf parameter map as plain values."""
    return {k: _param_value(v) for k, v in params.items()}


def _typed_to_raw(t: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...]) -> bytes:
    field = CONTENTS_FIELD.get(t.datatype)
    if field is None:
        raise InvalidArgument(
            f"input '{t.name}': {t.datatype} has no typed contents field; send it in "
            "raw_input_contents"
        )
    others = [f.name for f, v in t.contents.ListFields() if f.name != field and len(v) > 0]
    if others:
        raise InvalidArgument(
            f"input '{t.name}': {t.datatype} values go in contents.{field}; "
            f"contents.{', contents.'.join(others)} must be empty"
        )
    values = getattr(t.contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidArgument(
            f"input '{t.name}': {len(values)} values in contents.{field} but shape "
            f"{list(shape)} needs {count}"
        )
    if t.datatype == BYTES:
        return serialize_bytes(list(values))
    return np.asarray(values, dtype=numpy_dtype(t.datatype)).tobytes()


def request_from_proto(req: pb.ModelInferRequest, timeout_s: float | None) -> InferRequest:
    """Canonical request from a `ModelInferRequest`.

    Raises:
        InvalidArgument: unknown datatype, raw/typed contents that don't line up.
    """
    raw = req.raw_input_contents
    if raw:
        for t in req.inputs:
            if t.HasField("contents"):
                # Triton's wording, which its example clients look for.
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for "
                    f"'{t.name}' for model '{req.model_name}'"
                )
        if len(raw) != len(req.inputs):
            raise InvalidArgument(
                f"raw_input_contents has {len(raw)} entries but the request has "
                f"{len(req.inputs)} inputs"
            )
    tensors = []
    shm_inputs = {}
    for i, t in enumerate(req.inputs):
        if t.datatype not in ALL_DATATYPES:
            raise InvalidArgument(
                f"input '{t.name}': unknown datatype {t.datatype!r}; expected one of "
                f"{sorted(ALL_DATATYPES)}"
            )
        shape = tuple(t.shape)  # int64 already
        if shape and min(shape) < 0:
            raise InvalidArgument(f"input '{t.name}': shape {list(shape)} has a negative dimension")
        ref = shm_ref(parameter_values(t.parameters), f"input '{t.name}'") if t.parameters else None
        if ref is not None:
            if t.HasField("contents") or (raw and raw[i]):  # raw: one (empty) entry per input
                raise InvalidArgument(
                    f"input '{t.name}': its data is in shared memory; send no contents for it"
                )
            shm_inputs[t.name] = ref
            data: bytes = b""
        elif raw:
            data = raw[i]
        else:
            data = _typed_to_raw(t, shape)
        tensors.append(Tensor(t.name, t.datatype, shape, data))
    priority = 0
    timeout_override = timeout_s
    for key, value in req.parameters.items() if req.parameters else ():
        if key not in ("priority", "timeout"):
            continue
        v = _param_value(value)
        if type(v) is not int or v < 0:
            raise InvalidArgument(
                f"parameter '{key}' must be a non-negative int64_param or uint64_param, "
                f"got {value.WhichOneof('parameter_choice') or 'nothing'} {v!r}"
            )
        if key == "priority":
            priority = v
        elif v > 0:
            # Triton's convention: the request parameter "timeout" is in microseconds.
            timeout_s = v / 1e6
            timeout_override = (
                timeout_s if timeout_override is None else min(timeout_s, timeout_override)
            )
    outputs = []
    classification: dict[str, int] = {}
    shm_outputs = {}
    for o in req.outputs:
        outputs.append(o.name)
        if not o.parameters:
            continue
        params = parameter_values(o.parameters)
        if "classification" in params:
            classification[o.name] = class_count(params["classification"], o.name)
        ref = shm_ref(params, f"output '{o.name}'")
        if ref is not None:
            if o.name in classification:
                # Triton's check and wording.
                raise InvalidArgument(
                    "Output can't set both 'shared_memory_region' and 'classification'"
                )
            shm_outputs[o.name] = ref
    return InferRequest(
        model=req.model_name,
        version=req.model_version,
        id=req.id,
        inputs=tensors,
        outputs=outputs,
        priority=priority,
        timeout_s=timeout_override,
        classification=classification,
        sequence=sequence_flags(parameter_values(req.parameters)) if req.parameters else None,
        shm_inputs=shm_inputs,
        shm_outputs=shm_outputs,
    )


def response_to_proto(resp: InferResponse) -> pb.ModelInferResponse:
    """`ModelInferResponse` with raw output contents and stage timings as parameters."""
    out = pb.ModelInferResponse(model_name=resp.model, model_version=resp.version, id=resp.id)
    for t in resp.outputs:
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        # As Triton: one raw entry per output, empty for one written to shared
        # memory, so that raw_output_contents lines up with outputs by position
        # (Triton's C++ client indexes it that way).
        in_shm = t.name in resp.shm_outputs
        out.raw_output_contents.append(b"" if in_shm else bytes(t.data))
    for stage, ms in resp.timings_ms.items():
        out.parameters[f"inferbus_{stage}_us"].int64_param = int(ms * 1000)
    if resp.digest:
        out.parameters["inferbus_digest"].string_param = resp.digest
    if resp.degraded:
        out.parameters["inferbus_degraded"].string_param = resp.degraded
    return out
