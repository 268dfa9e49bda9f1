"""Checking an ONNX file against the tensors its `config.json` declares.

A version whose config promises inputs the model does not have would load on
a worker and then fail every request; the registry refuses it at upload with
a message that names the tensor and what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.tensorspec import TensorSpec

#: ONNX element type → KServe V2 datatype name.
ONNX_TO_V2: dict[int, str] = {
    TensorProto.BOOL: "BOOL",
    TensorProto.UINT8: "UINT8",
    TensorProto.UINT16: "UINT16",
    TensorProto.UINT32: "UINT32",
    TensorProto.UINT64: "UINT64",
    TensorProto.INT8: "INT8",
    TensorProto.INT16: "INT16",
    TensorProto.INT32: "INT32",
    TensorProto.INT64: "INT64",
    TensorProto.FLOAT16: "FP16",
    TensorProto.FLOAT: "FP32",
    TensorProto.DOUBLE: "FP64",
    TensorProto.STRING: "BYTES",
}


def _value_info_shape(vi: onnx.ValueInfoProto) -> tuple[str, list[int] | None]:
    """(V2 datatype or ONNX type name, dims with -1 for symbolic/unknown; None = unranked)."""
    ttype = vi.type.tensor_type
    dtype = ONNX_TO_V2.get(ttype.elem_type, TensorProto.DataType.Name(ttype.elem_type))
    if not ttype.HasField("shape"):
        return dtype, None
    dims = [
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in ttype.shape.dim
    ]
    return dtype, dims


def _compare(kind: str, spec: TensorSpec, vi: onnx.ValueInfoProto, model: str) -> None:
    if not vi.type.HasField("tensor_type"):
        raise InvalidArgument(f"{model}: ONNX {kind} '{spec.name}' is not a tensor")
    dtype, dims = _value_info_shape(vi)
    if dtype != spec.datatype:
        raise InvalidArgument(
            f"{model}: {kind} '{spec.name}' is {spec.datatype} in config.json "
            f"but {dtype} in the ONNX model"
        )
    if dims is None:
        return  # the model accepts any rank; nothing to compare
    if len(dims) != len(spec.shape):
        raise InvalidArgument(
            f"{model}: {kind} '{spec.name}' has rank {len(spec.shape)} in config.json "
            f"{spec.shape} but rank {len(dims)} in the ONNX model {dims}"
        )
    for axis, (want, have) in enumerate(zip(spec.shape, dims, strict=True)):
        # A symbolic ONNX dim (-1) accepts any size the config allows; a fixed
        # ONNX dim must be matched exactly, or the config would admit requests
        # the model cannot run.
        if have != -1 and want != have:
            raise InvalidArgument(
                f"{model}: {kind} '{spec.name}' dimension {axis} is {want} in config.json "
                f"but {have} in the ONNX model (config {spec.shape}, model {dims}; "
                "-1 means any size)"
            )


def check_onnx(path: Path, config: ModelConfig) -> None:
    """Open `path` with the `onnx` package and compare its graph with `config`.

    Every config input must be a graph input (and every graph input without an
    initializer must be in the config), every config output a graph output,
    with the same element type, the same rank and compatible dimensions.

    Raises:
        InvalidArgument: when the file is not a valid ONNX model or differs
            from the config; the message names the tensor and both sides.
    """
    model = config.name or "model"
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, ValueError, ... on garbage
        raise InvalidArgument(f"{model}: {path.name} is not a valid ONNX model: {exc}") from exc
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidArgument(f"{model}: {path.name} fails the ONNX checker: {first}") from exc

    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    graph_inputs = {vi.name: vi for vi in graph.input if vi.name not in initializers}
    graph_outputs = {vi.name: vi for vi in graph.output}

    for spec in config.inputs:
        vi = graph_inputs.get(spec.name)
        if vi is None:
            raise InvalidArgument(
                f"{model}: config.json input '{spec.name}' is not an input of the ONNX model; "
                f"the model's inputs are {sorted(graph_inputs)}"
            )
        _compare("input", spec, vi, model)
    declared = {s.name for s in config.inputs}
    undeclared = sorted(set(graph_inputs) - declared)
    if undeclared:
        raise InvalidArgument(
            f"{model}: the ONNX model needs input(s) {undeclared} that config.json does not declare"
        )
    for spec in config.outputs:
        vi = graph_outputs.get(spec.name)
        if vi is None:
            raise InvalidArgument(
                f"{model}: config.json output '{spec.name}' is not an output of the ONNX model; "
                f"the model's outputs are {sorted(graph_outputs)}"
            )
        _compare("output", spec, vi, model)


def derive_config(path: Path, model: str) -> ModelConfig:
    """A config for an ONNX file pushed without one (Triton's auto-complete).

    Inputs are the graph inputs that are not initializers, outputs the graph
    outputs, with their element types as V2 datatypes and their dimensions
    (``-1`` for symbolic or unknown ones). When every input and output has a
    symbolic first dimension the model batches along it: ``max_batch_size``
    is the default (32) with dynamic batching's defaults; otherwise it is 0
    and shapes are taken literally. Everything else gets its default.

    Raises:
        InvalidArgument: the file is not valid ONNX, or a tensor has no
            element type inferbus knows or no rank (give a config.json then).
    """
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, ValueError, ... on garbage
        raise InvalidArgument(f"{model}: {path.name} is not a valid ONNX model: {exc}") from exc
    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    tensors: dict[str, list[dict[str, Any]]] = {"inputs": [], "outputs": []}
    for kind, infos in (
        ("inputs", [vi for vi in graph.input if vi.name not in initializers]),
        ("outputs", list(graph.output)),
    ):
        for vi in infos:
            if not vi.type.HasField("tensor_type"):
                raise InvalidArgument(
                    f"{model}: ONNX {kind[:-1]} '{vi.name}' is not a tensor; push a config.json"
                )
            dtype, dims = _value_info_shape(vi)
            if dtype not in ONNX_TO_V2.values():
                raise InvalidArgument(
                    f"{model}: ONNX {kind[:-1]} '{vi.name}' has element type {dtype}, which "
                    "inferbus does not serve; push a config.json"
                )
            if dims is None:
                raise InvalidArgument(
                    f"{model}: ONNX {kind[:-1]} '{vi.name}' has no shape (rank unknown); push a "
                    "config.json with its shape"
                )
            tensors[kind].append({"name": vi.name, "datatype": dtype, "shape": dims})
    every = tensors["inputs"] + tensors["outputs"]
    batched = bool(every) and all(t["shape"] and t["shape"][0] == -1 for t in every)
    fields: dict[str, object] = {"name": model, "file": path.name, **tensors}
    if not batched:
        fields["max_batch_size"] = 0
    try:
        return ModelConfig.model_validate(fields)
    except ValueError as exc:
        raise InvalidArgument(f"{model}: cannot derive a config from {path.name}: {exc}") from exc
