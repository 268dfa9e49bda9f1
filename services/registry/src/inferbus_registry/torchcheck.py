"""PyTorch artifacts at push, read without torch (the registry never imports it).

Both formats are zip archives:

* TorchScript (``model.pt``, ``torch.jit.save``): holds the program's code
  (``<root>/code/...``). A ``torch.save`` of a module or a state dict is a
  zip too, but only pickled Python objects: no worker could load it without
  the model's source, so it is refused here, saying what to push instead.
  TorchScript records no input shapes: the config.json names the tensors.
* torch.export (``model.pt2``, ``torch.export.save``): its graph is JSON
  (``<root>/models/model.json``) with the signature's tensors, their dtypes
  and sizes (symbolic ones are ``-1`` here, their bounds in
  ``range_constraints``). For a batching config, axis 0 must take
  1..``max_batch_size`` rows. `check_torch_file` compares the
  config's engine tensors with it (count, datatype, rank, fixed dimensions;
  names are free: the worker passes inputs by position), and
  `derive_torch_config` writes the config of a ``.pt2`` pushed without one
  (Triton's auto-complete).
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.tensorspec import TensorSpec

log = logging.getLogger(__name__)

PT2_DATATYPES = {
    1: "UINT8",
    2: "INT8",
    3: "INT16",
    4: "INT32",
    5: "INT64",
    6: "FP16",
    7: "FP32",
    8: "FP64",
    12: "BOOL",
    28: "UINT16",
    34: "UINT32",
    35: "UINT64",
}
"""torch.export's serialized ``ScalarType`` codes → V2 datatypes (the ones inferbus serves)."""


def _archive(path: Path, model: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise InvalidArgument(
            f"{model}: {path.name} is not a TorchScript or torch.export archive "
            f"(not a zip file: {exc})"
        ) from None


@dataclass(frozen=True)
class Signature:
    """What a torch.export archive says about its user inputs and outputs."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    first_dims: list[int | tuple[int, int] | None]
    """Per input, axis 0: a fixed size, the (min, max) of its symbol, or None
    (no axis, or an expression this reader does not bound)."""


_SYMBOL = re.compile(r"^Symbol\('(\w+)'")


def pt2_signature(path: Path, model: str) -> Signature | None:
    """The user inputs and outputs of a torch.export archive, None when unreadable.

    None: the archive has no graph JSON this reader knows (another torch
    version's layout); the config is then taken as it is.

    Raises:
        InvalidArgument: not a zip, or a tensor of a dtype inferbus does not serve.
    """
    with _archive(path, model) as archive:
        graphs = [n for n in archive.namelist() if n.endswith("/models/model.json")]
        if len(graphs) != 1:
            return None
        try:
            doc = json.loads(archive.read(graphs[0]))
            module = doc["graph_module"]
            values: dict[str, Any] = module["graph"]["tensor_values"]
            specs = module["signature"]
            inputs = [s["user_input"]["arg"] for s in specs["input_specs"] if "user_input" in s]
            outputs = [s["user_output"]["arg"] for s in specs["output_specs"] if "user_output" in s]
            ranges: dict[str, Any] = doc.get("range_constraints", {})
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("%s: unknown torch.export graph layout (%r); not checked", path.name, exc)
            return None
    in_specs = _specs("input", inputs, values, model)
    return Signature(
        in_specs,
        _specs("output", outputs, values, model),
        [_first_dim(values[s.name], ranges) for s in in_specs],
    )


def _first_dim(meta: dict[str, Any], ranges: dict[str, Any]) -> int | tuple[int, int] | None:
    sizes = meta.get("sizes") or []
    if not sizes:
        return None
    first = sizes[0]
    if "as_int" in first:
        return int(first["as_int"])
    match = _SYMBOL.match(str(first.get("as_expr", {}).get("expr_str", "")))
    bounds = ranges.get(match.group(1)) if match else None
    if not isinstance(bounds, dict):
        return None
    try:
        return int(bounds["min_val"]), int(bounds["max_val"])
    except (KeyError, TypeError, ValueError):  # an unbounded max is serialized otherwise
        return None


def _check_batch_axis(config: ModelConfig, signature: Signature, model: str) -> None:
    """A batching config needs a program whose axis 0 takes 1..max_batch_size rows."""
    if config.max_batch_size <= 0:
        return
    for spec, first in zip(signature.inputs, signature.first_dims, strict=True):
        where = f"{model}: the exported program's input '{spec.name}'"
        if isinstance(first, int):
            raise InvalidArgument(
                f"{where} takes exactly {first} row(s) on axis 0, and config.json batches "
                f"(max_batch_size {config.max_batch_size}): export it with a dynamic batch "
                "dimension (torch.export.Dim) or set max_batch_size 0"
            )
        if isinstance(first, tuple):
            low, high = first
            if low > 1 or high < config.max_batch_size:
                raise InvalidArgument(
                    f"{where} takes {low}..{high} rows on axis 0; config.json's batches hold "
                    f"1..{config.max_batch_size} (max_batch_size): export with "
                    f"Dim(min=1, max>={config.max_batch_size}) or lower max_batch_size"
                )


def _specs(kind: str, args: list[Any], values: dict[str, Any], model: str) -> list[TensorSpec]:
    specs = []
    for i, arg in enumerate(args):
        name = arg.get("as_tensor", {}).get("name") if isinstance(arg, dict) else None
        if name is None or name not in values:
            raise InvalidArgument(
                f"{model}: the exported program's {kind} {i} is not a tensor ({arg}); inferbus "
                "passes and answers tensors only"
            )
        meta = values[name]
        datatype = PT2_DATATYPES.get(meta.get("dtype"))
        if datatype is None:
            raise InvalidArgument(
                f"{model}: the exported program's {kind} '{name}' has torch dtype code "
                f"{meta.get('dtype')}, which inferbus does not serve"
            )
        shape = [s["as_int"] if "as_int" in s else -1 for s in meta.get("sizes", [])]
        specs.append(TensorSpec(name=name, datatype=datatype, shape=shape))
    return specs


def _compare(kind: str, want: list[TensorSpec], got: list[TensorSpec], model: str) -> None:
    if len(want) != len(got):
        raise InvalidArgument(
            f"{model}: config.json names {len(want)} {kind}(s) {[s.name for s in want]}; the "
            f"exported program has {len(got)} ({[s.name for s in got]})"
        )
    for spec, real in zip(want, got, strict=True):
        where = f"{model}: {kind} '{spec.name}' (the program's '{real.name}')"
        if spec.datatype != real.datatype:
            raise InvalidArgument(
                f"{where} is {real.datatype} in the program, {spec.datatype} in config.json"
            )
        if len(spec.shape) != len(real.shape) or any(
            w != -1 and g != -1 and w != g for w, g in zip(spec.shape, real.shape, strict=True)
        ):
            raise InvalidArgument(
                f"{where} has shape {real.shape} in the program, {spec.shape} in config.json"
            )


def check_torch_file(path: Path, config: ModelConfig, model: str) -> None:
    """Refuse a PyTorch artifact no worker could serve as `config` says.

    Raises:
        InvalidArgument: not an archive of the file's format, or (``.pt2``)
            tensors that disagree with the config's engine tensors.
    """
    if path.suffix == ".pt2":
        signature = pt2_signature(path, model)
        if signature is not None:
            view = config.engine_view()
            _compare("input", view.inputs, signature.inputs, model)
            _compare("output", view.outputs, signature.outputs, model)
            _check_batch_axis(config, signature, model)
        return
    with _archive(path, model) as archive:
        names = archive.namelist()
    if not any("/code/" in n for n in names):
        raise InvalidArgument(
            f"{model}: {path.name} holds no TorchScript code (a torch.save of a module or "
            "state dict?); push torch.jit.script(module).save(...) as model.pt, or a "
            "torch.export program as model.pt2"
        )


def derive_torch_config(path: Path, model: str) -> ModelConfig:
    """The config of a ``.pt2`` pushed without one, from its signature.

    Batched (``max_batch_size`` 32, or less when axis 0's bound is lower) when
    every tensor's first dimension is symbolic; otherwise ``max_batch_size`` 0.

    Raises:
        InvalidArgument: a TorchScript file (it records no shapes), or an
            archive whose signature cannot be read.
    """
    if path.suffix != ".pt2":
        raise InvalidArgument(
            f"{model}: {path.name} is TorchScript, which records no input shapes: push a "
            "config.json naming its inputs and outputs (engine.kind 'pytorch')"
        )
    signature = pt2_signature(path, model)
    if signature is None:
        raise InvalidArgument(
            f"{model}: cannot read the signature of {path.name}: push a config.json"
        )
    inputs, outputs = signature.inputs, signature.outputs
    every = [*inputs, *outputs]
    batched = bool(every) and all(s.shape and s.shape[0] == -1 for s in every)
    # Batches as large as every input's axis 0 takes, up to the usual 32.
    highs = [f[1] for f in signature.first_dims if isinstance(f, tuple)]
    fields: dict[str, object] = {
        "name": model,
        "file": path.name,
        "engine": {"kind": "pytorch"},
        "inputs": [s.model_dump(exclude_defaults=True) for s in inputs],
        "outputs": [s.model_dump(exclude_defaults=True) for s in outputs],
    }
    if not batched:
        fields["max_batch_size"] = 0
    elif highs and min(highs) < 32:
        fields["max_batch_size"] = min(highs)
    try:
        return ModelConfig.model_validate(fields)
    except ValueError as exc:
        raise InvalidArgument(f"{model}: cannot derive a config from {path.name}: {exc}") from exc
