"""ONNX Runtime engine: CPU, CUDA or TensorRT execution providers.

BYTES tensors are object arrays of ``bytes`` everywhere else in the worker;
ONNX Runtime's Python API wants ``str`` for string tensors (it turns any
other object into its ``repr``, so ``b"hi"`` would reach the model as the
text ``"b'hi'"``) and gives ``str`` back. The engine decodes string inputs as
UTF-8 (refusing bytes that are not) and encodes string outputs back, so the
rest of the worker only ever sees bytes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.modelconfig import EngineConfig
from inferbus_worker.engines.base import EngineError, EngineInputError, PermanentEngineError

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
        self._string_inputs: frozenset[str] = frozenset()
        self._string_outputs: frozenset[str] = frozenset()

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
        self._string_inputs = frozenset(
            m.name for m in self._session.get_inputs() if m.type == _ORT_STRING
        )
        self._string_outputs = frozenset(
            m.name for m in self._session.get_outputs() if m.type == _ORT_STRING
        )

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run zeros through the model once per batch size.

        String inputs get ``"0"``: text that also parses as a number, so a
        model that casts or parses its strings accepts it (an empty string
        does not parse). A model with string inputs that still refuses it
        (it wants some other format) is not warmed up: warm-up only spares
        the first requests some latency, and such a model serves well-formed
        requests fine. A model without string inputs that fails warm-up is
        broken, and loading it fails.

        Raises:
            EngineError: the model failed on zeros and has no string inputs.
        """
        for batch in batch_sizes:
            feeds = {}
            for meta in self._session.get_inputs():
                shape = [d if isinstance(d, int) and d > 0 else 1 for d in meta.shape]
                if batch > 0 and shape:
                    shape[0] = batch
                dtype = _ORT_NUMPY.get(meta.type, np.float32)
                arr = np.zeros(shape, dtype=dtype)
                if dtype is np.object_:
                    arr.fill("0")
                feeds[meta.name] = arr
            try:
                self._session.run(None, feeds)
            # ORT raises its own exception classes (CancelledError is no Exception).
            except Exception as exc:
                if not self._string_inputs:
                    raise EngineError(f"warm-up failed on zeros: {exc}") from exc
                log.warning(
                    "%s: warm-up with '0' for its string inputs failed, serving without "
                    "warm-up: %s",
                    self._path.name,
                    " ".join(str(exc).split())[:300],
                )
                return

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Run the session; see `Engine.run`."""
        session = self._session
        if session is None:
            raise EngineError("engine is not loaded")
        feeds = dict(inputs)
        for name in self._string_inputs.intersection(feeds):
            feeds[name] = texts_for_ort(name, feeds[name])
        try:
            results = session.run(list(output_names), feeds)
        except self._input_errors as exc:
            raise EngineInputError(f"model rejected the inputs: {_one_line(exc)}") from exc
        # ORT's Fail/RuntimeException and the like (CancelledError is no Exception).
        except Exception as exc:
            if permanent_failure(exc):
                if input_fault(exc):
                    raise EngineInputError(
                        f"the model cannot compute these inputs: {_one_line(exc)}"
                    ) from exc
                raise PermanentEngineError(
                    f"the model fails on these inputs (on every retry): {_one_line(exc)}"
                ) from exc
            raise EngineError(f"inference failed: {_one_line(exc)}") from exc
        out = dict(zip(output_names, results, strict=True))
        for name in self._string_outputs.intersection(out):
            out[name] = bytes_from_ort(out[name])
        return out

    def close(self) -> None:
        """Drop the session (ONNX Runtime frees its memory with it)."""
        self._session = None


_ORT_STRING = "tensor(string)"

_DEVICE_MARKERS = ("alloc", "memory", "cuda", "cudnn", "cublas", "tensorrt", "device", "gpu")
"""Words in an ONNX Runtime error that point at the device, not at the input."""


def permanent_failure(exc: BaseException) -> bool:
    """Whether an ONNX Runtime run failure will happen again for the same inputs.

    A kernel that fails on its data (a string that does not parse as a
    number, an index out of range) reports "Non-zero status code returned
    while running <op> node" and fails the same way every time, on any
    worker; retrying only delays the answer. Failures that mention memory or
    the device (an allocation, CUDA, TensorRT) may pass on a retry.
    """
    text = str(exc)
    if "while running" not in text:
        return False
    lowered = text.lower()
    return not any(marker in lowered for marker in _DEVICE_MARKERS)


_INPUT_FAULT = re.compile(
    r"\bsto(?:i|l|ll|ul|ull|f|d|ld)\b|out of (?:data )?bounds|out of range", re.IGNORECASE
)
"""What a kernel failing on its input's values says: a string that does not parse as
a number (C++ ``std::stoll`` and kin, as string Casts report it), an index outside
the data (Gather, embedding lookups)."""


def input_fault(exc: BaseException) -> bool:
    """Whether a permanent run failure is the input's fault (else the model's).

    Only failures that name a value the input brought count: a text that is
    no number, an index out of range. Anything else (a Reshape that cannot
    hold the batch, an op the graph misuses) is the model's fault: the
    client cannot fix it, and a rollout must see it as the model failing.
    """
    return _INPUT_FAULT.search(str(exc)) is not None


def _one_line(exc: BaseException) -> str:
    """An exception's text on one line (reply headers hold no line breaks)."""
    return " ".join(str(exc).split())


def texts_for_ort(name: str, values: np.ndarray) -> np.ndarray:
    """A BYTES tensor as ONNX Runtime takes string tensors: an object array of `str`.

    ``bytes`` elements are decoded as UTF-8 (ONNX strings are text);
    ``str`` (and ``np.str_``) elements pass as they are.

    Raises:
        EngineInputError: an element is not valid UTF-8 (naming its flat index).
    """
    flat = values.reshape(-1)
    try:
        texts = [v.decode("utf-8") if isinstance(v, bytes) else _text(v) for v in flat]
    except UnicodeDecodeError as exc:
        bad = next(i for i, v in enumerate(flat) if not _decodes(v))
        raise EngineInputError(
            f"input '{name}' element {bad} is not UTF-8 text ({exc.reason} at byte "
            f"{exc.start}); the model's string inputs take UTF-8"
        ) from None
    out = np.empty(len(texts), dtype=object)
    out[:] = texts
    return out.reshape(values.shape)


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8")
    return str(value)


def _decodes(value: object) -> bool:
    try:
        _text(value)
    except UnicodeDecodeError:
        return False
    return True


def bytes_from_ort(values: np.ndarray) -> np.ndarray:
    """A string tensor from ONNX Runtime (``str`` elements) as an object array of UTF-8 bytes."""
    flat = values.reshape(-1)
    out = np.empty(flat.size, dtype=object)
    out[:] = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in flat]
    return out.reshape(values.shape)


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
