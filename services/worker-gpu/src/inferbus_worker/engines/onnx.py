"""ONNX Runtime engine: CPU, CUDA or TensorRT execution providers."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.modelconfig import EngineConfig
from inferbus_worker.engines.base import EngineError, EngineInputError

log = logging.getLogger(__name__)

_PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
"""Config names → ONNX Runtime execution provider names."""


def choose_providers(
    wanted: Sequence[str], available: Sequence[str], *, trt_cache_dir: Path | None = None
) -> list[str | tuple[str, dict[str, Any]]]:
    """Providers to open a session with: `wanted` (in order) that are `available`.

    Args:
        wanted: config names (``cpu``, ``cuda``, ``tensorrt``) in order of preference.
        available: what ``onnxruntime.get_available_providers()`` reports.
        trt_cache_dir: where the TensorRT provider keeps built engines, so a
            restart does not rebuild them (minutes for large models).

    Raises:
        EngineError: none of the wanted providers is available here.
    """
    chosen: list[str | tuple[str, dict[str, Any]]] = []
    for name in wanted:
        provider = _PROVIDER_NAMES[name]
        if provider not in available:
            log.warning("execution provider %s is not available here; skipping it", provider)
            continue
        if provider == "TensorrtExecutionProvider":
            opts: dict[str, Any] = {"trt_fp16_enable": False}
            if trt_cache_dir is not None:
                trt_cache_dir.mkdir(parents=True, exist_ok=True)
                opts |= {
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(trt_cache_dir),
                    "trt_timing_cache_enable": True,
                    "trt_timing_cache_path": str(trt_cache_dir),
                }
            chosen.append((provider, opts))
        elif provider == "CUDAExecutionProvider":
            chosen.append((provider, {"device_id": 0}))
        else:
            chosen.append(provider)
    if not chosen:
        raise EngineError(
            f"none of the execution providers {list(wanted)} is available "
            f"(this onnxruntime has {list(available)})"
        )
    return chosen


class OnnxRuntimeEngine:
    """Runs an ONNX model with ONNX Runtime.

    One `InferenceSession` serves every concurrent `run`: ONNX Runtime's
    ``run`` is thread-safe and releases the GIL while computing.

    Args:
        path: the ``.onnx`` file.
        engine: the config's engine section (providers, thread counts).
        trt_cache_dir: engine cache of the TensorRT execution provider.
    """

    def __init__(self, path: Path, engine: EngineConfig, *, trt_cache_dir: Path | None = None):
        self._path = path
        self._engine = engine
        self._trt_cache_dir = trt_cache_dir
        self._session: Any = None
        self._providers: list[str] = []
        self._input_errors: tuple[type[BaseException], ...] = ()

    @property
    def description(self) -> str:
        """``onnxruntime[<providers>]``."""
        return f"onnxruntime[{','.join(self._providers)}]"

    @property
    def providers(self) -> list[str]:
        """Providers the session really uses, in order."""
        return list(self._providers)

    def load(self) -> None:
        """Open the inference session."""
        import onnxruntime as ort
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

        self._input_errors = (ort_state.InvalidArgument, ValueError, TypeError)
        providers = choose_providers(
            self._engine.providers,
            ort.get_available_providers(),
            trt_cache_dir=self._trt_cache_dir,
        )
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self._engine.intra_op_threads
        opts.inter_op_num_threads = self._engine.inter_op_threads
        if self._engine.inter_op_threads > 1:
            opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(str(self._path), opts, providers=providers)
        # ORT raises its own exception classes for bad files (CancelledError is no Exception).
        except Exception as exc:
            raise EngineError(f"cannot load {self._path.name}: {exc}") from exc
        self._providers = self._session.get_providers()

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run zeros through the model once per batch size."""
        for batch in batch_sizes:
            feeds = {}
            for meta in self._session.get_inputs():
                shape = [d if isinstance(d, int) and d > 0 else 1 for d in meta.shape]
                if batch > 0 and shape:
                    shape[0] = batch
                dtype = _ORT_NUMPY.get(meta.type, np.float32)
                arr = np.zeros(shape, dtype=dtype)
                if dtype is np.object_:
                    arr.fill("")
                feeds[meta.name] = arr
            self._session.run(None, feeds)

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Run the session; see `Engine.run`."""
        session = self._session
        if session is None:
            raise EngineError("engine is not loaded")
        try:
            results = session.run(list(output_names), dict(inputs))
        except self._input_errors as exc:
            raise EngineInputError(f"model rejected the inputs: {exc}") from exc
        # ORT's Fail/RuntimeException and the like (CancelledError is no Exception).
        except Exception as exc:
            raise EngineError(f"inference failed: {exc}") from exc
        return dict(zip(output_names, results, strict=True))

    def close(self) -> None:
        """Drop the session (ONNX Runtime frees its memory with it)."""
        self._session = None


_ORT_NUMPY: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
    "tensor(string)": np.object_,
}
"""ONNX Runtime type strings → numpy dtypes (for warm-up tensors)."""
