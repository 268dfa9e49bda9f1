"""Native TensorRT engine for serialized ``.plan`` files (TensorRT 10 API).

GPU ONLY: this module needs an NVIDIA GPU, the ``tensorrt`` package and
``cuda-python`` (the worker's ``gpu`` extra). Both are imported lazily in
`TensorRTEngine.load`, so CPU-only workers never import them; on a machine
without a GPU its tests are skipped.

Memory is handled with the CUDA runtime bindings of ``cuda-python`` (no
pycuda, no torch): each execution slot owns a CUDA stream, an execution
context and device buffers that grow to the largest batch seen. Inputs are
copied from the (zero-copy) numpy views straight to the device; outputs come
back into fresh host arrays that the worker slices per request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.engineconfig import DeviceKind
from inferbus_worker.engines.base import EngineError, EngineInputError, ProviderUnavailable

log = logging.getLogger(__name__)


def _import_cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart  # older cuda-python layout
    return cudart


@dataclass
class _Slot:
    """What one concurrent execution owns."""

    context: Any
    stream: Any
    buffers: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Tensor name → (device pointer, capacity in bytes)."""


class TensorRTEngine:
    """Runs a serialized TensorRT engine (``model.plan``).

    Args:
        path: the ``.plan`` file, built for this GPU and TensorRT version.
        instance_count: concurrent executions (one context and stream each).
        device: CUDA device ordinal.
    """

    def __init__(self, path: Path, *, instance_count: int = 1, device: int = 0) -> None:
        self._path = path
        self._instances = instance_count
        self._device = device
        self._trt: Any = None
        self._cudart: Any = None
        self._runtime: Any = None
        self._logger: Any = None
        self._engine: Any = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._dtypes: dict[str, np.dtype] = {}
        self._slots: queue.Queue[_Slot] = queue.Queue()
        self._all_slots: list[_Slot] = []
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        """``tensorrt[cuda:<device>]``."""
        return f"tensorrt[cuda:{self._device}]"

    @property
    def device_kind(self) -> DeviceKind:
        """Always ``gpu``: a TensorRT plan runs nowhere else (it fails to load instead)."""
        return "gpu"

    def _check(self, result: Any) -> Any:
        """Unwrap a cuda-python ``(err, *values)`` tuple, raising on errors."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cudart.cudaError_t.cudaSuccess:
            _, name = self._cudart.cudaGetErrorName(err)
            raise EngineError(
                f"CUDA call failed: {name.decode() if isinstance(name, bytes) else name}"
            )
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def load(self) -> None:
        """Deserialize the engine and create one context and stream per instance."""
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise EngineError("the tensorrt package is not installed (use the gpu extra)") from exc
        try:
            self._cudart = _import_cudart()
        except ImportError as exc:
            raise EngineError("cuda-python is not installed (use the gpu extra)") from exc
        self._trt = trt
        try:
            self._check(self._cudart.cudaSetDevice(self._device))
        except EngineError as exc:
            # No visible GPU (or not this one): a plan cannot run anywhere else.
            raise ProviderUnavailable(
                f"TensorRT cannot use GPU {self._device}: {exc.message}"
            ) from exc
        self._logger = _logger(trt)  # TensorRT keeps no reference of its own
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(self._path.read_bytes())
        if self._engine is None:
            raise EngineError(
                f"cannot deserialize {self._path.name} (built for another GPU or TensorRT version?)"
            )
        for i in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(i)
            self._dtypes[name] = np.dtype(trt.nptype(self._engine.get_tensor_dtype(name)))
            if self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self._inputs.append(name)
            else:
                self._outputs.append(name)
        for _ in range(self._instances):
            context = self._engine.create_execution_context()
            if context is None:
                raise EngineError("cannot create a TensorRT execution context (GPU memory?)")
            stream = self._check(self._cudart.cudaStreamCreate())
            slot = _Slot(context, stream)
            self._all_slots.append(slot)
            self._slots.put(slot)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run zeros once per batch size on every slot (allocates its buffers)."""
        for batch in batch_sizes:
            feeds = {}
            for name in self._inputs:
                shape = [d if d > 0 else 1 for d in self._engine.get_tensor_shape(name)]
                if batch > 0 and shape:
                    shape[0] = batch
                feeds[name] = np.zeros(shape, dtype=self._dtypes[name])
            for _ in range(self._instances):
                self.run(feeds, self._outputs)

    def _buffer(self, slot: _Slot, name: str, nbytes: int) -> int:
        ptr, capacity = slot.buffers.get(name, (0, 0))
        if nbytes <= capacity:
            return ptr
        if ptr:
            self._check(self._cudart.cudaFree(ptr))
        # Round up so batch sizes that creep up do not reallocate every time.
        capacity = max(256, 1 << (max(nbytes, 1) - 1).bit_length())
        ptr = int(self._check(self._cudart.cudaMalloc(capacity)))
        slot.buffers[name] = (ptr, capacity)
        return ptr

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Copy inputs in, enqueue the engine, copy outputs out; see `Engine.run`."""
        if self._engine is None:
            raise EngineError("engine is not loaded")
        unknown = [n for n in output_names if n not in self._outputs]
        if unknown:
            raise EngineInputError(f"unknown outputs {unknown}; the engine has {self._outputs}")
        slot = self._slots.get()
        try:
            return self._run_on(slot, inputs, output_names)
        finally:
            self._slots.put(slot)

    def _run_on(
        self, slot: _Slot, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        cudart = self._cudart
        # The CUDA runtime's current device is per thread; pool threads start on device 0.
        self._check(cudart.cudaSetDevice(self._device))
        ctx = slot.context
        keep_alive = []
        for name in self._inputs:
            if name not in inputs:
                raise EngineInputError(f"missing input '{name}'")
            host = np.ascontiguousarray(inputs[name])
            if host.dtype != self._dtypes[name]:
                raise EngineInputError(
                    f"input '{name}' is {host.dtype}, the engine wants {self._dtypes[name]}"
                )
            if not ctx.set_input_shape(name, host.shape):
                raise EngineInputError(f"input '{name}' shape {host.shape} is outside the profile")
            ptr = self._buffer(slot, name, host.nbytes)
            self._check(
                cudart.cudaMemcpyAsync(
                    ptr,
                    host.ctypes.data,
                    host.nbytes,
                    cudart.cudaMemcpyKind.cudaMemcpyHostToDevice,
                    slot.stream,
                )
            )
            ctx.set_tensor_address(name, ptr)
            keep_alive.append(host)
        outputs: dict[str, np.ndarray] = {}
        for name in self._outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineInputError(f"output '{name}' shape {shape} is not determined")
            host = np.empty(shape, dtype=self._dtypes[name])
            ptr = self._buffer(slot, name, host.nbytes)
            ctx.set_tensor_address(name, ptr)
            outputs[name] = host
        if not ctx.execute_async_v3(slot.stream):
            raise EngineError("TensorRT execute_async_v3 failed")
        for name in output_names:
            host = outputs[name]
            ptr, _ = slot.buffers[name]
            self._check(
                cudart.cudaMemcpyAsync(
                    host.ctypes.data,
                    ptr,
                    host.nbytes,
                    cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                    slot.stream,
                )
            )
        self._check(cudart.cudaStreamSynchronize(slot.stream))
        del keep_alive
        return {name: outputs[name] for name in output_names}

    def close(self) -> None:
        """Free device buffers, streams, contexts and the engine."""
        if self._cudart is None:
            return
        with self._lock:
            for slot in self._all_slots:
                for ptr, _ in slot.buffers.values():
                    self._cudart.cudaFree(ptr)
                slot.buffers.clear()
                self._cudart.cudaStreamDestroy(slot.stream)
                slot.context = None
            self._all_slots.clear()
            self._engine = None
            self._runtime = None


def _logger(trt: Any) -> Any:
    """A TensorRT logger that writes through Python logging (JSON lines), not to stderr."""
    levels = {
        trt.ILogger.Severity.INTERNAL_ERROR: logging.CRITICAL,
        trt.ILogger.Severity.ERROR: logging.ERROR,
        trt.ILogger.Severity.WARNING: logging.WARNING,
        trt.ILogger.Severity.INFO: logging.DEBUG,  # per-layer chatter at INFO
        trt.ILogger.Severity.VERBOSE: logging.DEBUG,
    }

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            log.log(levels.get(severity, logging.WARNING), "tensorrt: %s", msg)

    return _Logger()
