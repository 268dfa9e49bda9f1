"""The engine section of a version's `config.json` and its instance group.

One GPU vocabulary for the whole project: a config names execution
providers (``cpu``, ``cuda``, ``tensorrt``); `GPU_PROVIDERS` are the ones that
compute on a GPU, and `device_kind` says where a config's engine computes
(``cpu`` or ``gpu``). The worker's engines report the same words for what
they really got (``Engine.device_kind``), the gateway's model config reports
Triton's ``KIND_CPU`` / ``KIND_GPU`` from them.

Provider options are checked here, at push, with the names ONNX Runtime
uses for them (`CudaOptions.provider_options`, `TensorRTOptions.provider_options`),
so a typo or an out-of-range value is refused by the registry, not found by
a worker at load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

if TYPE_CHECKING:
    from inferbus_common.modelconfig import ModelConfig

DeviceKind = Literal["cpu", "gpu"]
"""Where an engine computes."""

ProviderName = Literal["cpu", "cuda", "tensorrt", "openvino"]
"""Config provider names (``openvino``: ONNX Runtime's OpenVINO EP, from the
separate onnxruntime-openvino wheel; a worker without it refuses the version)."""

GPU_PROVIDERS = frozenset({"cuda", "tensorrt"})
"""Config provider names that compute on a GPU."""

TORCH_PROVIDERS = frozenset({"cpu", "cuda"})
"""Where the PyTorch engine computes (``cuda``: torch's CUDA device)."""

TORCH_FILES = (".pt", ".pt2")
"""Artifacts of ``kind: pytorch``: TorchScript (``model.pt``) or torch.export (``model.pt2``)."""


def _flag(value: bool) -> str:
    return "1" if value else "0"


class CudaOptions(BaseModel):
    """Options of ONNX Runtime's CUDA execution provider (``engine.cuda``).

    Field names are ONNX Runtime's own option names, except `io_binding`,
    which is inferbus's: how the worker feeds the session.
    """

    model_config = ConfigDict(extra="forbid")

    device_id: int = Field(default=0, ge=0)
    """GPU index among the ones the worker sees (``CUDA_VISIBLE_DEVICES``)."""
    use_tf32: bool = True
    """TF32 tensor-core math for float32 MatMul/Conv on Ampere and later (ONNX
    Runtime's default). Faster, but only ~1e-3 relative precision: a 487 MB MLP
    on an H200 differed from the CPU by 5.9e-04 with it, 1.1e-06 without."""
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "EXHAUSTIVE"
    """How cuDNN picks a convolution algorithm (EXHAUSTIVE benchmarks them once per shape)."""
    gpu_mem_limit: int | None = Field(default=None, gt=0)
    """Bytes the provider's memory arena may hold; None: no limit."""
    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = "kNextPowerOfTwo"
    """How the arena grows: doubling (fewer allocations) or exactly what is asked (less waste)."""
    enable_cuda_graph: bool = False
    """Capture the graph once per input shape and replay it (needs every node on
    CUDA and static shapes per batch size; the worker binds inputs and outputs
    at fixed addresses per batch size for it)."""
    io_binding: bool = True
    """Feed the session through IO binding: inputs copied once into pinned host
    buffers and to the GPU, outputs bound on the GPU once per batch size and
    copied back once (False: numpy in and out, ONNX Runtime's copies)."""

    def provider_options(self, device_id: int | None = None) -> dict[str, str]:
        """These options as ONNX Runtime's CUDA provider takes them (strings).

        Args:
            device_id: overrides `device_id` (an instance placed on another GPU).
        """
        opts = {
            "device_id": str(self.device_id if device_id is None else device_id),
            "use_tf32": _flag(self.use_tf32),
            "cudnn_conv_algo_search": self.cudnn_conv_algo_search,
            "arena_extend_strategy": self.arena_extend_strategy,
            "enable_cuda_graph": _flag(self.enable_cuda_graph),
        }
        if self.gpu_mem_limit is not None:
            opts["gpu_mem_limit"] = str(self.gpu_mem_limit)
        return opts


class TensorRTOptions(BaseModel):
    """Options of ONNX Runtime's TensorRT execution provider (``engine.tensorrt``)."""

    model_config = ConfigDict(extra="forbid")

    device_id: int = Field(default=0, ge=0)
    """GPU index among the ones the worker sees (``CUDA_VISIBLE_DEVICES``)."""
    fp16: bool = False
    """Let TensorRT pick FP16 kernels (about 1e-3 relative precision instead of 1e-6)."""
    int8: bool = False
    """Let TensorRT pick INT8 kernels (models with Q/DQ nodes: explicit quantisation)."""
    max_workspace_bytes: int | None = Field(default=None, gt=0)
    """Scratch memory TensorRT may use while building; None: TensorRT's default."""
    engine_cache: bool = True
    """Keep built engines in the worker's TensorRT cache directory (restarts skip the build)."""
    timing_cache: bool = True
    """Keep layer timings in the same directory (later builds of similar models are faster)."""
    builder_optimization_level: int = Field(default=3, ge=0, le=5)
    """TensorRT's builder effort, 0..5 (3 is TensorRT's default; 5 builds longest)."""
    cuda_graph: bool = False
    """Capture and replay CUDA graphs for the TensorRT subgraphs."""

    def provider_options(
        self, cache_dir: str | None, device_id: int | None = None
    ) -> dict[str, str]:
        """These options as ONNX Runtime's TensorRT provider takes them (strings).

        Args:
            cache_dir: the worker's engine/timing cache directory (None: no caches).
            device_id: overrides `device_id` (an instance placed on another GPU).
        """
        opts = {
            "device_id": str(self.device_id if device_id is None else device_id),
            "trt_fp16_enable": _flag(self.fp16),
            "trt_int8_enable": _flag(self.int8),
            "trt_builder_optimization_level": str(self.builder_optimization_level),
            "trt_cuda_graph_enable": _flag(self.cuda_graph),
        }
        if self.max_workspace_bytes is not None:
            opts["trt_max_workspace_size"] = str(self.max_workspace_bytes)
        if cache_dir is not None and self.engine_cache:
            opts |= {"trt_engine_cache_enable": "1", "trt_engine_cache_path": cache_dir}
        if cache_dir is not None and self.timing_cache:
            opts |= {"trt_timing_cache_enable": "1", "trt_timing_cache_path": cache_dir}
        return opts


class EngineConfig(BaseModel):
    """Which engine runs the model and how."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["onnxruntime", "tensorrt", "pytorch", "vllm"] = "onnxruntime"
    """``pytorch``: a TorchScript (``.pt``) or torch.export (``.pt2``) program run by
    torch (a worker without torch refuses it); ``vllm``: a generative model served by
    the LLM worker (see `GenerationConfig`)."""
    providers: list[ProviderName] = ["cpu"]  # pydantic copies defaults
    """Execution providers in order of preference (one that does not start gives way
    to the next). Without ``cpu`` in the list the version must get one of them: a
    worker where none starts (no GPU, no CUDA libraries) refuses the version
    instead of computing on the CPU."""
    intra_op_threads: int = Field(default=1, ge=0)
    inter_op_threads: int = Field(default=1, ge=0)
    cuda: CudaOptions | None = None
    """CUDA provider options (None: ONNX Runtime's defaults, IO binding on)."""
    tensorrt: TensorRTOptions | None = None
    """TensorRT provider options (None: the defaults above)."""

    @field_validator("providers")
    @classmethod
    def _providers(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("engine.providers needs at least one provider")
        if len(set(value)) != len(value):
            raise ValueError(f"engine.providers names a provider twice: {value}")
        return value

    @model_validator(mode="after")
    def _options_match(self) -> EngineConfig:
        if self.kind == "onnxruntime":
            for name in ("cuda", "tensorrt"):
                if getattr(self, name) is not None and name not in self.providers:
                    raise ValueError(
                        f"engine.{name} options are given but engine.providers "
                        f"{self.providers} does not use the {name} provider"
                    )
        elif self.kind == "tensorrt":
            if self.cuda is not None:
                raise ValueError("engine.cuda does not apply to kind 'tensorrt' (a TensorRT plan)")
            trt = self.tensorrt
            if trt is not None and trt.model_fields_set - {"device_id"}:
                raise ValueError(
                    "kind 'tensorrt' loads a built plan: only engine.tensorrt.device_id "
                    "applies (precision and workspace were fixed when the plan was built)"
                )
        elif self.kind == "pytorch":
            other = [p for p in self.providers if p not in TORCH_PROVIDERS]
            if other:
                raise ValueError(
                    f"kind 'pytorch' computes on {sorted(TORCH_PROVIDERS)}; engine.providers "
                    f"names {other}"
                )
            if self.tensorrt is not None:
                raise ValueError("engine.tensorrt does not apply to kind 'pytorch'")
            cuda = self.cuda
            extra = cuda.model_fields_set - {"device_id"} if cuda is not None else set()
            if cuda is not None and ("cuda" not in self.providers or extra):
                raise ValueError(
                    "kind 'pytorch': only engine.cuda.device_id applies, with 'cuda' in "
                    "engine.providers (the other options are ONNX Runtime's)"
                )
        elif self.cuda is not None or self.tensorrt is not None:
            raise ValueError("engine.cuda / engine.tensorrt apply to tensor engines only")
        return self

    @model_serializer(mode="wrap")
    def _omit_absent_options(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Configs without options dump byte for byte as before options existed
        # (unchanged digests; services of the previous release still read them).
        data: dict[str, Any] = handler(self)
        for name in ("cuda", "tensorrt"):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def device_kind(self) -> DeviceKind:
        """Where this engine computes when it gets its first provider."""
        if self.kind == "tensorrt" or self.providers[0] in GPU_PROVIDERS:
            return "gpu"
        return "cpu"

    @property
    def cpu_allowed(self) -> bool:
        """Whether the version may compute on the CPU (``cpu`` is among its providers)."""
        return self.kind in ("onnxruntime", "pytorch") and "cpu" in self.providers


class InstanceGroup(BaseModel):
    """Triton's ``instance_group``: engine instances per worker, each with its own session.

    ``count`` instances run on each GPU of `gpus` (or ``count`` in all when
    `gpus` is empty); each instance takes one micro-batch at a time, so a
    worker keeps up to `instances` batches of the version in flight.
    """

    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=1, ge=1, le=64)
    kind: Literal["KIND_AUTO", "KIND_CPU", "KIND_GPU"] = "KIND_AUTO"
    """KIND_CPU: the instances run on the CPU provider even when the config lists
    GPU providers first; KIND_GPU: they must get a GPU; KIND_AUTO: the providers decide."""
    gpus: list[int] = Field(default_factory=list)
    """GPU indices among the ones the worker sees; empty: the worker places them
    (on the visible GPU with the most free memory)."""

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: list[int]) -> list[int]:
        if any(g < 0 for g in value):
            raise ValueError("instance_group.gpus are GPU indices (0 or more)")
        if len(set(value)) != len(value):
            raise ValueError(f"instance_group.gpus names a GPU twice: {value}")
        return value

    @property
    def instances(self) -> int:
        """Engine instances per worker."""
        return self.count * max(1, len(self.gpus))


def check_instance_group(config: ModelConfig) -> None:
    """Cross-check ``instance_group`` with the engine and align ``instance_count``.

    ``instance_count`` (concurrent executions per worker) follows the group:
    each instance runs one execution at a time.

    Raises:
        ValueError: the group contradicts the engine or ``instance_count``.
    """
    group = config.instance_group
    if group is None:
        return
    engine = config.engine
    if engine.kind == "vllm":
        raise ValueError("instance_group applies to tensor engines, not to 'vllm'")
    if group.kind == "KIND_CPU":
        if not engine.cpu_allowed:
            raise ValueError(
                "instance_group.kind KIND_CPU needs an onnxruntime or pytorch engine with 'cpu' in "
                f"engine.providers (has {engine.kind} {engine.providers})"
            )
        if group.gpus:
            raise ValueError("instance_group.gpus does not apply to KIND_CPU")
    elif group.kind == "KIND_GPU" and engine.device_kind != "gpu":
        raise ValueError(
            "instance_group.kind KIND_GPU needs a GPU provider first in engine.providers "
            f"(has {engine.providers})"
        )
    if group.gpus and engine.device_kind != "gpu":
        raise ValueError("instance_group.gpus needs a GPU provider first in engine.providers")
    if config.instance_count not in (1, group.instances):
        raise ValueError(
            f"instance_count {config.instance_count} contradicts instance_group "
            f"({group.instances} instances): give only instance_group"
        )
    config.instance_count = group.instances


def instance_device_kind(config: ModelConfig) -> DeviceKind:
    """Where the version's engine instances compute (the group's kind, else the engine's)."""
    group = config.instance_group
    if group is not None and group.kind == "KIND_CPU":
        return "cpu"
    return config.engine.device_kind


TORCH_PLATFORM = "pytorch_libtorch"
"""Triton's platform name for PyTorch models (the default ``platform`` of kind pytorch)."""


def check_torch(config: ModelConfig) -> None:
    """Cross-check a ``pytorch`` engine with its file and tensors; fill its defaults.

    A config of kind ``pytorch`` that leaves ``platform`` or ``file`` out gets
    Triton's ``pytorch_libtorch`` and ``model.pt``. Its file must be a ``.pt``
    (TorchScript) or ``.pt2`` (torch.export) program, and its engine tensors
    fixed-size (torch has no string tensors); a ``.pt``/``.pt2`` file under
    another kind is refused rather than handed to ONNX Runtime.

    Raises:
        ValueError: the kind, file or tensors do not fit together.
    """
    if config.engine.kind != "pytorch":
        if config.file.endswith(TORCH_FILES):
            raise ValueError(
                f"file {config.file!r} is a PyTorch program: set engine.kind to 'pytorch'"
            )
        return
    if "platform" not in config.model_fields_set:
        config.platform = TORCH_PLATFORM
    if "file" not in config.model_fields_set:
        config.file = "model.pt"
    if not config.file.endswith(TORCH_FILES):
        raise ValueError(
            f"kind 'pytorch' loads a TorchScript .pt or torch.export .pt2 file, not {config.file!r}"
        )
    strings = [
        s.name for s in [*config.engine_inputs(), *config.engine_outputs()] if s.datatype == "BYTES"
    ]
    if strings:
        raise ValueError(
            f"kind 'pytorch' has no string tensors: {strings} are BYTES (turn text into "
            "numbers in processing or a preprocessor.py)"
        )
