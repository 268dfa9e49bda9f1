"""PyTorch engine: TorchScript (``model.pt``) and torch.export (``model.pt2``) programs.

torch is not a dependency of the worker: it lives in a separate environment
(``scripts/bootstrap-torch.sh`` makes ``.venvs/torch``; a worker started with
``.venvs/torch/bin/python -m inferbus_worker`` serves these versions). It is
imported in `TorchEngine.load` only, so a worker without it starts and serves
every other version, and refuses a PyTorch version with `TorchUnavailable`
(FAILED_PRECONDITION: the version is ``failed permanently`` on that worker,
and the message says where torch comes from).

* TorchScript: ``torch.jit.load(path, map_location=device)``.
* torch.export: ``torch.export.load(path).module()``, moved to the device.

Inputs are passed positionally in the order of the config's (engine) inputs;
a program that returns one tensor answers the config's only output, a tuple
or list answers the outputs in order, a dict answers them by name. Runs go
through the worker's micro-batch path like any engine (axis 0 is the batch),
each under ``torch.inference_mode()``; one module serves every concurrent
`run` (PyTorch releases the GIL in its kernels).

Devices: the config's providers in order, ``cpu`` or ``cuda`` (torch's CUDA
device ``cuda:<device_id>``, used when ``torch.cuda.is_available()``); a
version whose providers leave ``cpu`` out and whose GPU is not there is
refused (`ProviderUnavailable`), never computed on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.datatypes import numpy_dtype
from inferbus_common.engineconfig import DeviceKind
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.tensorspec import TensorSpec
from inferbus_worker.engines.base import (
    EngineError,
    EngineInputError,
    PermanentEngineError,
    ProviderUnavailable,
)
from inferbus_worker.engines.onnx import input_fault

log = logging.getLogger(__name__)

BOOTSTRAP = "scripts/bootstrap-torch.sh"
"""What makes the environment torch versions are served from."""


class TorchUnavailable(ProviderUnavailable):
    """This worker's environment has no (working) torch: it cannot serve the version."""


def import_torch(what: str) -> Any:
    """``import torch``, or `TorchUnavailable` saying what needs it and where torch comes from.

    Args:
        what: the version (or file) that needs torch, named in the error.
    """
    try:
        import torch
    # OSError: a CUDA build of torch whose CUDA libraries this host lacks.
    except (ImportError, OSError) as exc:
        raise TorchUnavailable(
            f"{what} is a PyTorch program and this worker has no torch ({exc}): serve it "
            f"from a worker started with .venvs/torch/bin/python -m inferbus_worker (made by "
            f"{BOOTSTRAP}), or pip install torch==2.13.0 into the worker's environment"
        ) from None
    return torch


class TorchEngine:
    """Runs a TorchScript or torch.export program with PyTorch.

    Args:
        path: the ``.pt`` (TorchScript) or ``.pt2`` (torch.export) file.
        config: the version's config (providers, threads, engine tensors).
        device_id: the GPU this instance was placed on (None: ``engine.cuda``'s, else 0).
        cpu_only: compute on the CPU whatever the providers (an instance group of KIND_CPU).
        label: the version in words, for errors (``fraud version 3``).
    """

    def __init__(
        self,
        path: Path,
        config: ModelConfig,
        *,
        device_id: int | None = None,
        cpu_only: bool = False,
        label: str = "",
    ) -> None:
        self._path = path
        self._config = config
        self._device_id = device_id
        self._cpu_only = cpu_only
        self._label = label or path.name
        self._inputs: list[TensorSpec] = list(config.engine_view().inputs)
        self._outputs: list[str] = [s.name for s in config.engine_view().outputs]
        self._torch: Any = None
        self._module: Any = None
        self._device: Any = None
        self._format = "torch.export" if path.suffix == ".pt2" else "torchscript"

    @property
    def description(self) -> str:
        """``torch <version>[<format> on <device>]``."""
        version = self._torch.__version__ if self._torch is not None else "?"
        return f"torch {version}[{self._format} on {self._device or 'unloaded'}]"

    @property
    def device_kind(self) -> DeviceKind:
        """``gpu`` when the module lives on a CUDA device."""
        return "gpu" if self._device is not None and self._device.type == "cuda" else "cpu"

    def _gpu(self) -> int:
        if self._device_id is not None:
            return self._device_id
        cuda = self._config.engine.cuda
        return cuda.device_id if cuda is not None else 0

    def _choose_device(self, torch: Any) -> Any:
        """The first of the config's providers this process can compute on.

        Raises:
            ProviderUnavailable: none of them (a ``cuda`` version without a GPU here).
        """
        wanted = ["cpu"] if self._cpu_only else list(self._config.engine.providers)
        missing: list[str] = []
        for name in wanted:
            if name == "cpu":
                if missing:
                    log.warning("%s: %s; computing on the CPU", self._label, "; ".join(missing))
                return torch.device("cpu")
            gpu = self._gpu()
            if not torch.cuda.is_available():
                missing.append(f"torch {torch.__version__} sees no CUDA device")
            elif gpu >= torch.cuda.device_count():
                missing.append(f"GPU {gpu} is not among the {torch.cuda.device_count()} visible")
            else:
                return torch.device("cuda", gpu)
        raise ProviderUnavailable(
            f"{self._label}: {'; '.join(missing)}, and the config does not allow the CPU "
            "(no 'cpu' in engine.providers)"
        )

    def load(self) -> None:
        """Import torch, pick the device, load the program onto it.

        Raises:
            TorchUnavailable: torch is not importable here.
            ProviderUnavailable: the config wants a GPU this process does not have.
            EngineError: the file is no program torch can load.
        """
        torch = import_torch(self._label)
        self._torch = torch
        device = self._choose_device(torch)
        threads = self._config.engine.intra_op_threads
        if threads > 0:
            # Process-wide in torch (the last version loaded sets it).
            torch.set_num_threads(threads)
        try:
            if self._format == "torch.export":
                program = torch.export.load(str(self._path))
                module = program.module().to(device)
            else:
                module = torch.jit.load(str(self._path), map_location=device)
                module.eval()
        except Exception as exc:
            raise EngineError(
                f"cannot load {self._path.name} as a {self._format} program: {_one_line(exc)}"
            ) from exc
        self._module = module
        self._device = device

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run zeros once per batch size and check the outputs against the config.

        Raises:
            EngineError: the program fails on zeros, answers another number of
                outputs than the config names, or another dtype than it says.
        """
        for batch in batch_sizes:
            feeds = {}
            for spec in self._inputs:
                shape = [d if d > 0 else 1 for d in spec.shape]
                if batch > 0 and shape:
                    shape[0] = batch
                feeds[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
            try:
                out = self.run(feeds, self._outputs)
            except (EngineError, EngineInputError) as exc:
                raise EngineError(f"warm-up failed on zeros: {exc.message}") from exc
            for spec in self._config.engine_view().outputs:
                want = numpy_dtype(spec.datatype)
                if out[spec.name].dtype != want:
                    raise EngineError(
                        f"{self._path.name} gives {out[spec.name].dtype} for output "
                        f"'{spec.name}'; config.json says {spec.datatype} ({want})"
                    )

    def _tensor(self, name: str, array: np.ndarray) -> Any:
        # torch.from_numpy shares memory; a read-only array (a view of the request's
        # bytes) is copied first, since a program may write its inputs in place.
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C", copy=True)
        tensor = self._torch.from_numpy(array)
        if self._device.type != "cpu":
            tensor = tensor.to(self._device, non_blocking=False)
        return tensor

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Call the program on `inputs` (positional, config order); see `Engine.run`."""
        module = self._module
        if module is None:
            raise EngineError("engine is not loaded")
        torch = self._torch
        missing = [s.name for s in self._inputs if s.name not in inputs]
        if missing:
            raise EngineInputError(f"missing input(s) {missing}")
        unknown = [n for n in output_names if n not in self._outputs]
        if unknown:
            raise EngineInputError(f"unknown outputs {unknown}; the model has {self._outputs}")
        args = [self._tensor(s.name, inputs[s.name]) for s in self._inputs]
        try:
            with torch.inference_mode():
                result = module(*args)
                outputs = self._named(result)
                return {
                    name: outputs[name].detach().to("cpu").contiguous().numpy()
                    for name in output_names
                }
        except (EngineError, EngineInputError):
            raise
        except Exception as exc:
            text = _one_line(exc)
            if "out of memory" in text.lower():
                raise EngineError(f"inference failed: {text}") from exc
            if input_fault(exc):
                raise EngineInputError(f"the model cannot compute these inputs: {text}") from exc
            raise PermanentEngineError(
                f"the model fails on these inputs (on every retry): {text}"
            ) from exc

    def _named(self, result: Any) -> dict[str, Any]:
        """The program's result as ``{output name: tensor}`` (see the module docstring).

        Raises:
            PermanentEngineError: the result does not match the config's outputs.
        """
        torch = self._torch
        names = self._outputs
        if isinstance(result, torch.Tensor):
            values = [result]
        elif isinstance(result, dict):
            absent = [n for n in names if n not in result]
            if absent:
                raise PermanentEngineError(
                    f"{self._path.name} answers {sorted(result)}, not the outputs {absent}"
                )
            return {n: result[n] for n in names}
        elif isinstance(result, tuple | list):
            values = list(result)
        else:
            raise PermanentEngineError(
                f"{self._path.name} returns {type(result).__name__}, not tensors"
            )
        if len(values) != len(names) or not all(isinstance(v, torch.Tensor) for v in values):
            raise PermanentEngineError(
                f"{self._path.name} returns {len(values)} value(s); config.json names "
                f"{len(names)} output(s) {names}"
            )
        return dict(zip(names, values, strict=True))

    def close(self) -> None:
        """Drop the module (and, on a GPU, the memory torch's allocator caches for it)."""
        on_gpu = self.device_kind == "gpu"
        self._module = None
        if on_gpu and self._torch is not None:
            self._torch.cuda.empty_cache()


def _one_line(exc: BaseException) -> str:
    """An exception's text on one line (torch's errors carry C++ stack traces)."""
    return " ".join(str(exc).split())[:1500]
