"""ONNX Runtime engine: CPU, CUDA or TensorRT execution providers.

BYTES tensors are object arrays of ``bytes`` everywhere else in the worker;
ONNX Runtime's Python API wants ``str`` for string tensors (it turns any
other object into its ``repr``, so ``b"hi"`` would reach the model as the
text ``"b'hi'"``) and gives ``str`` back. The engine decodes string inputs as
UTF-8 (refusing bytes that are not) and encodes string outputs back, so the
rest of the worker only ever sees bytes.

Providers: the session is opened with the config's providers and their
options (`choose_providers`), ONNX Runtime's CPU fallback off. A provider
that fails to start gives way to the next one the config lists; a session
that ends up on a provider the config does not list (the CPU, for a
``["cuda"]`` version) is refused (`check_session_providers`,
`ProviderUnavailable`: FAILED_PRECONDITION, quoting ONNX Runtime's lines).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inferbus_common.engineconfig import (
    GPU_PROVIDERS,
    CudaOptions,
    DeviceKind,
    EngineConfig,
    TensorRTOptions,
)
from inferbus_worker.engines.base import (
    EngineError,
    EngineInputError,
    PermanentEngineError,
    ProviderUnavailable,
)
from inferbus_worker.engines.iobinding import CudaBinding
from inferbus_worker.engines.nativelog import RELAY

log = logging.getLogger(__name__)

_PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    # onnxruntime-openvino's wheel; not in the default environment (it replaces
    # onnxruntime), so a version asking for it alone is refused with
    # ProviderUnavailable (FAILED_PRECONDITION) by a worker without it.
    "openvino": "OpenVINOExecutionProvider",
}
"""Config names → ONNX Runtime execution provider names."""

_GPU_EXECUTION_PROVIDERS = frozenset(_PROVIDER_NAMES[name] for name in GPU_PROVIDERS)

Provider = str | tuple[str, dict[str, str]]
"""A provider as ``InferenceSession`` takes it: a name, or a name and its options."""


def provider_name(provider: Provider) -> str:
    """The execution provider's name, with or without options."""
    return provider if isinstance(provider, str) else provider[0]


def choose_providers(
    wanted: Sequence[str],
    available: Sequence[str],
    *,
    cuda: CudaOptions | None = None,
    tensorrt: TensorRTOptions | None = None,
    trt_cache_dir: Path | None = None,
    device_id: int | None = None,
) -> list[Provider]:
    """Providers to open a session with: `wanted` (in order) that are `available`.

    Args:
        wanted: config names (``cpu``, ``cuda``, ``tensorrt``, ``openvino``) in order
            of preference.
        available: what ``onnxruntime.get_available_providers()`` reports.
        cuda: the version's CUDA options (None: the defaults).
        tensorrt: the version's TensorRT options (None: the defaults).
        trt_cache_dir: where the TensorRT provider keeps built engines, so a
            restart does not rebuild them (minutes for large models).
        device_id: the GPU this instance was placed on (overrides the options').

    Raises:
        ProviderUnavailable: none of the wanted providers is in this build.
    """
    chosen: list[Provider] = []
    for name in wanted:
        provider = _PROVIDER_NAMES[name]
        if provider not in available:
            log.warning("execution provider %s is not available here; skipping it", provider)
            continue
        if name == "tensorrt":
            cache = None
            if trt_cache_dir is not None:
                trt_cache_dir.mkdir(parents=True, exist_ok=True)
                cache = str(trt_cache_dir)
            opts = (tensorrt or TensorRTOptions()).provider_options(cache, device_id)
            chosen.append((provider, opts))
        elif name == "cuda":
            chosen.append((provider, (cuda or CudaOptions()).provider_options(device_id)))
        elif name == "openvino":
            # OpenVINO on the CPU, said rather than left to the wheel's build default
            # (a GPU/NPU build would otherwise pick its own device).
            chosen.append((provider, {"device_type": "CPU"}))
        else:
            chosen.append(provider)
    if not chosen:
        raise ProviderUnavailable(
            f"none of the execution providers {list(wanted)} is available "
            f"(this onnxruntime has {list(available)})"
        )
    return chosen


def check_session_providers(
    asked: Sequence[Provider], got: Sequence[str], *, cpu_allowed: bool, why: Sequence[str] = ()
) -> None:
    """Refuse a session that computes on a provider the config did not ask for.

    ONNX Runtime drops a provider that cannot start (no visible GPU, CUDA
    libraries not found) with a warning and computes on the CPU; a version
    whose config leaves ``cpu`` out must not be served that way. A session
    that got a later provider of the config's list (TensorRT did not start,
    CUDA did) serves, with a warning naming the one that did not start.

    Args:
        asked: the providers the session was opened with, in order.
        got: what the session reports (``get_providers()``).
        cpu_allowed: the config lists ``cpu``: any outcome is acceptable.
        why: ONNX Runtime's own log lines from opening the session.

    Raises:
        ProviderUnavailable: the session's first provider is none the config asked for.
    """
    if not asked:
        return
    names = [provider_name(p) for p in asked]
    reason = " | ".join(" ".join(w.split()) for w in why if w.strip())
    first = names[0]
    if got and got[0] == first:
        return
    if cpu_allowed or (got and got[0] in names):
        log.warning(
            "execution provider %s did not start; the session runs on %s%s",
            first,
            list(got),
            f": {reason[:1500]}" if reason else "",
        )
        return
    raise ProviderUnavailable(
        f"execution provider {first} did not start (the session got {list(got)}), and the "
        "config does not allow the CPU (no 'cpu' in engine.providers)"
        + (f": {reason[:1500]}" if reason else "")
    )


class OnnxRuntimeEngine:
    """Runs an ONNX model with ONNX Runtime.

    One `InferenceSession` serves every concurrent `run`: ONNX Runtime's
    ``run`` is thread-safe and releases the GIL while computing. On the CUDA
    provider with ``io_binding`` (the default) runs go through
    `inferbus_worker.engines.iobinding` instead: one copy in, one out.

    Args:
        path: the ``.onnx`` file.
        engine: the config's engine section (providers, thread counts, options).
        trt_cache_dir: engine cache of the TensorRT execution provider.
        device_id: the GPU this instance was placed on (None: the options' own).
        cpu_only: run on the CPU provider alone (an instance group of KIND_CPU).
        batched: the model's axis 0 is the batch axis (``max_batch_size`` > 0).
        batch_sizes: the sizes CUDA graphs are captured for (padded up to).
    """

    def __init__(
        self,
        path: Path,
        engine: EngineConfig,
        *,
        trt_cache_dir: Path | None = None,
        device_id: int | None = None,
        cpu_only: bool = False,
        batched: bool = True,
        batch_sizes: Sequence[int] = (),
    ):
        self._path = path
        self._engine = engine
        self._trt_cache_dir = trt_cache_dir
        self._device_id = device_id
        self._cpu_only = cpu_only
        self._batched = batched
        self._batch_sizes = tuple(batch_sizes)
        self._session: Any = None
        self._binding: Any = None
        self._providers: list[str] = []
        self._input_errors: tuple[type[BaseException], ...] = ()
        self._string_inputs: frozenset[str] = frozenset()
        self._string_outputs: frozenset[str] = frozenset()

    @property
    def description(self) -> str:
        """``onnxruntime[<providers>]`` (and the GPU and feeding when on CUDA)."""
        text = f"onnxruntime[{','.join(self._providers)}]"
        if self.device_kind == "gpu":
            text += f" on cuda:{self._gpu()}"
        if self._binding is not None:
            text += f" {self._binding.description}"
        return text

    @property
    def providers(self) -> list[str]:
        """Providers the session really uses, in order."""
        return list(self._providers)

    @property
    def device_kind(self) -> DeviceKind:
        """``gpu`` when the session's first provider computes on a GPU."""
        if self._providers and self._providers[0] in _GPU_EXECUTION_PROVIDERS:
            return "gpu"
        return "cpu"

    def _gpu(self) -> int:
        if self._device_id is not None:
            return self._device_id
        options = self._engine.cuda or self._engine.tensorrt
        return options.device_id if options is not None else 0

    def load(self) -> None:
        """Open the inference session, on the provider asked for or not at all.

        Raises:
            ProviderUnavailable: the config leaves ``cpu`` out and its first
                provider is missing or did not start (ONNX Runtime's reason quoted).
            EngineError: the file is no model ONNX Runtime can open.
        """
        import onnxruntime as ort
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

        self._input_errors = (ort_state.InvalidArgument, ValueError, TypeError)
        wanted = ["cpu"] if self._cpu_only else self._engine.providers
        cpu_allowed = self._cpu_only or self._engine.cpu_allowed
        providers = choose_providers(
            wanted,
            ort.get_available_providers(),
            cuda=self._engine.cuda,
            tensorrt=self._engine.tensorrt,
            trt_cache_dir=self._trt_cache_dir,
            device_id=self._device_id,
        )
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self._engine.intra_op_threads
        opts.inter_op_num_threads = self._engine.inter_op_threads
        if self._engine.inter_op_threads > 1:
            opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Warnings too: they reach the JSON log through the native log relay, and
        # say why a provider did not start or which nodes fell back to the CPU.
        opts.log_severity_level = 2
        mark = RELAY.mark()
        asked = list(providers)
        while True:
            try:
                # ONNX Runtime's own fallback is off: it would retry on the CPU alone
                # (whatever the config allows) and print why to stdout.
                session = ort.InferenceSession(
                    str(self._path), opts, providers=providers, enable_fallback=0
                )
                break
            # ORT raises its own exception classes (CancelledError is no Exception).
            except Exception as exc:
                failed = provider_name(providers[0])
                if _mentions_device(exc) and len(providers) > 1:
                    # The next provider the config lists (the CPU only when listed).
                    log.warning(
                        "execution provider %s failed to start for %s, trying %s: %s",
                        failed,
                        self._path.name,
                        provider_name(providers[1]),
                        _one_line(exc)[:1500],
                    )
                    providers = providers[1:]
                    continue
                if not cpu_allowed and _mentions_device(exc):
                    raise ProviderUnavailable(
                        f"execution provider {failed} failed to start for "
                        f"{self._path.name}: {_one_line(exc)[:1500]}"
                    ) from exc
                raise EngineError(f"cannot load {self._path.name}: {exc}") from exc
        check_session_providers(
            asked,
            session.get_providers(),
            cpu_allowed=cpu_allowed,
            why=RELAY.lines_since(mark),
        )
        self._session = session
        self._providers = session.get_providers()
        self._string_inputs = frozenset(
            m.name for m in session.get_inputs() if m.type == _ORT_STRING
        )
        self._string_outputs = frozenset(
            m.name for m in session.get_outputs() if m.type == _ORT_STRING
        )
        cuda = self._engine.cuda or CudaOptions()
        if (
            self._providers[0] == "CUDAExecutionProvider"
            and (cuda.io_binding or cuda.enable_cuda_graph)
            and not (self._string_inputs or self._string_outputs)
        ):
            dtypes = {
                m.name: _ORT_NUMPY.get(m.type, np.float32)
                for m in [*session.get_inputs(), *session.get_outputs()]
            }
            self._binding = CudaBinding(
                session,
                self._gpu(),
                dtypes=dtypes,
                batched=self._batched,
                cuda_graph=cuda.enable_cuda_graph,
                batch_sizes=self._batch_sizes,
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
                if self._binding is not None:
                    # Through the binding: it allocates its buffers (and with CUDA
                    # graphs captures the graph) for each size here, not on a request.
                    outputs = [m.name for m in self._session.get_outputs()]
                    self._binding.run(feeds, outputs)
                else:
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
            if self._binding is not None:
                return self._binding.run(feeds, output_names)
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
        if self._binding is not None:
            self._binding.close()
            self._binding = None
        self._session = None


_ORT_STRING = "tensor(string)"

_DEVICE_MARKERS = ("alloc", "memory", "cuda", "cudnn", "cublas", "tensorrt", "device", "gpu")
"""Words in an ONNX Runtime error that point at the device, not at the input."""


def _mentions_device(exc: BaseException) -> bool:
    """Whether a failure to open a session names the device or a provider."""
    lowered = str(exc).lower()
    return any(m in lowered for m in (*_DEVICE_MARKERS, "provider", "libcu", "nvidia"))


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
