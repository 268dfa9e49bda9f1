"""A model version's `config.json`: tensors, engine, batching, placement.

The same schema is validated by the registry at upload, read by the gateway
for request validation and metadata, by the batcher for its queue policy and
by the worker to build the engine. Sections with rules of their own live
beside it: `tensorspec` (one tensor), `processingconfig` (pre/post steps),
`sequencebatching` (stateful models) and `engineconfig` (engine, instances).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from inferbus_common.codec import (
    Buffer,
    Tensor,
    check_raw_size,
    deserialize_bytes,
    serialize_bytes,
)
from inferbus_common.engineconfig import (
    EngineConfig,
    InstanceGroup,
    check_instance_group,
    check_torch,
)
from inferbus_common.errors import InvalidArgument
from inferbus_common.imageformat import check_formats
from inferbus_common.processingconfig import ProcessingConfig, check_processing
from inferbus_common.sequencebatching import SequenceBatchingConfig, check_sequences
from inferbus_common.tensorspec import TensorSpec


class BatchingConfig(BaseModel):
    """Dynamic batching policy (the batcher's knobs, Triton's names)."""

    model_config = ConfigDict(extra="forbid")

    max_queue_delay_us: int = Field(default=500, ge=0)
    """How long the oldest request may wait for a batch to fill."""
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    """Sizes to dispatch at as soon as they are reached (ascending)."""
    max_queue_size: int = Field(default=1024, ge=1)
    """Requests waiting per priority level; beyond it → RESOURCE_EXHAUSTED."""
    default_timeout_ms: int = Field(default=30_000, ge=1)
    """Deadline given to requests that bring none."""
    priority_levels: int = Field(default=1, ge=1)
    """Number of priority levels; 1 is the highest."""
    default_priority: int = Field(default=1, ge=1)
    """Level of requests that ask for none."""

    @model_validator(mode="after")
    def _priorities(self) -> BatchingConfig:
        if self.default_priority > self.priority_levels:
            raise ValueError("default_priority must be within 1..priority_levels")
        return self


class GenerationConfig(BaseModel):
    """A generative model's engine and admission knobs (``engine.kind == "vllm"``).

    The version's files are a Hugging Face model directory (config, tokenizer,
    weights); `ModelConfig.file` names its ``config.json`` (e.g. ``hf/config.json``:
    the top-level ``config.json`` is this file), and the directory holding it is
    what vLLM loads.
    """

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(default=8, ge=1)
    """Sequences vLLM runs at once (continuous batching width)."""
    max_waiting: int = Field(default=256, ge=0)
    """Requests a worker accepts beyond `max_num_seqs` (queued in the engine) at
    most; more than ``max_num_seqs + max_waiting`` in flight → RESOURCE_EXHAUSTED
    at once. Below it, `deadline_admission` decides."""
    deadline_admission: bool = True
    """Refuse (429 with Retry-After) a request that would have to wait at this worker
    and, by the worker's recent requests, would not finish before its deadline
    (`inferbus_worker.llm.capacity`); False: admit everything up to the cap."""
    max_model_len: int = Field(default=2048, ge=16)
    """Longest prompt + completion, in tokens."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """GPU only: share of device memory vLLM may take (weights + KV cache)."""
    dtype: str = "auto"
    """Weights/activations dtype (``auto``, ``float32``, ``bfloat16``, ``float16``)."""
    kv_cache_space_gib: float = Field(default=1.0, gt=0)
    """CPU only: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    enforce_eager: bool | None = None
    """Skip graph capture/compilation; None: True on CPU, False on GPU."""
    default_max_tokens: int = Field(default=256, ge=1)
    """Completion length when the request gives no ``max_tokens``."""
    default_timeout_ms: int = Field(default=120_000, ge=1)
    """Deadline of a generation request that brings none."""


class FallbackConfig(BaseModel):
    """What the gateway may answer when the model cannot (breaker open, overload, outage).

    Exactly one of `outputs` (a fixed answer) or `model` (a backup model) is set.
    """

    model_config = ConfigDict(extra="forbid")

    outputs: dict[str, list[Any]] | None = None
    """Fixed answer: output name → the values of ONE batch row, flattened row-major
    (for ``max_batch_size == 0`` models, the whole tensor); repeated for every row."""
    model: str | None = None
    """Backup model to send the request to instead."""
    version: str | None = None
    """Version of the backup model (empty: its stable version)."""

    @model_validator(mode="after")
    def _one_kind(self) -> FallbackConfig:
        if (self.outputs is None) == (self.model is None):
            raise ValueError("fallback needs exactly one of 'outputs' or 'model'")
        if self.version is not None and self.model is None:
            raise ValueError("fallback 'version' needs 'model'")
        if self.outputs is not None and not self.outputs:
            raise ValueError("fallback 'outputs' must name at least one output")
        return self


class DecoupledConfig(BaseModel):
    """A tensor model that answers a request with 0..n responses (Triton's decoupled
    transaction policy, served over ``ModelStreamInfer``).

    The engine computes every response at once: each output has a *responses
    axis*, and response i carries index i along it of every output the client
    asked for (all outputs must have the same length along it; length 0 means
    no response, only the final flag). See docs/architecture.md ("Streaming and
    decoupled models").
    """

    model_config = ConfigDict(extra="forbid")

    axis: int = Field(default=0, ge=0)
    """The responses axis (counted in the full output shape, batch axis included)."""
    keep_axis: bool = True
    """Each response keeps the axis with length 1 (``OUT [n]`` → n responses of
    ``OUT [1]``, as Triton's repeat example); False drops it."""


_OMITTED_WHEN_DEFAULT: dict[str, Any] = {
    "processing": None,
    "generation": None,
    "slo_p99_ms": None,
    "load_policy": "eager",
    "sequence_batching": None,
    "decoupled": None,
    "instance_group": None,
}
"""`ModelConfig` fields added after the first release: left out of dumps at their default."""


class ModelConfig(BaseModel):
    """The `config.json` of one model version."""

    model_config = ConfigDict(extra="forbid")

    name: str = ""
    """Filled in by the registry from the push request when empty."""
    platform: str = "onnxruntime_onnx"
    file: str = "model.onnx"
    """Artifact file inside the version directory."""
    max_batch_size: int = Field(default=32, ge=0)
    """0 disables batching: shapes are then taken literally."""
    inputs: list[TensorSpec] = Field(min_length=1)
    outputs: list[TensorSpec] = Field(min_length=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    instance_count: int = Field(default=1, ge=1)
    """Concurrent executions of the model per worker (one shared session; with
    `instance_group`, its instance count: one session each)."""
    instance_group: InstanceGroup | None = None
    """Triton's instance group: engine instances with their own sessions, their
    kind and GPUs (see `inferbus_common.engineconfig`); None: one session."""
    pool: str = "default"
    """Worker pool the version is placed on."""
    slo_p99_ms: float | None = Field(default=None, gt=0)
    """Objective for the p99 end-to-end latency at the gateway, in ms. The gateway
    exports it (``inferbus_gateway_model_slo_seconds``) and the
    ``InferbusLatencyP99AboveSLO`` alert compares against it; None: the alert's
    default of 250 ms."""
    load_policy: Literal["eager", "lazy"] = "eager"
    """``eager``: workers load the version as soon as it is routed. ``lazy``: only
    when a request for it arrives (the gateway publishes a load hint); the first
    requests wait for it within their deadline or get UNAVAILABLE "loading, retry"."""
    fallback: FallbackConfig | None = None
    """Degraded answer used by the gateway when the model cannot answer; None: none."""
    generation: GenerationConfig | None = None
    """Generative models only (``engine.kind == "vllm"``): engine and admission knobs."""
    sequence_batching: SequenceBatchingConfig | None = None
    """A stateful model: requests carry a sequence id and go to one worker per
    sequence (Triton's sequence batcher); None: requests are independent."""
    decoupled: DecoupledConfig | None = None
    """Answer each request with 0..n responses split along an output axis (served
    over ModelStreamInfer only); None: one response per request."""

    @property
    def is_decoupled(self) -> bool:
        """0..n responses per request: generative models and `decoupled` tensor models."""
        return self.generative or self.decoupled is not None

    @property
    def generative(self) -> bool:
        """Served by the LLM worker (OpenAI endpoints), not by tensor inference."""
        return self.engine.kind == "vllm"

    processing: ProcessingConfig | None = None
    """Pre/post-processing run by the worker around the engine; None: the engine
    takes the client's inputs and gives the client's outputs as they are."""

    @model_serializer(mode="wrap")
    def _omit_absent_sections(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave absent optional sections out of dumps.

        A config without them then serialises byte for byte as before they
        existed: the registry's canonical config.json (and so the digests of
        re-pushed versions) does not change, and services of the previous
        release (``extra="forbid"``) still read configs and catalog records.
        """
        data: dict[str, Any] = handler(self)
        if isinstance(data, dict):
            for name, default in _OMITTED_WHEN_DEFAULT.items():
                if name in data and data[name] == default:
                    del data[name]
        return data

    @model_validator(mode="after")
    def _processing_fits(self) -> ModelConfig:
        check_processing(self)
        check_sequences(self)
        _check_decoupled(self)
        check_instance_group(self)
        check_torch(self)
        check_formats(self)
        return self

    def label_files(self) -> list[str]:
        """Labels files the outputs name (classification extension), sorted."""
        return sorted({s.label_filename for s in self.outputs if s.label_filename})

    def engine_inputs(self) -> list[TensorSpec]:
        """What the engine takes: `processing.engine_inputs`, else the client inputs."""
        if self.processing is not None and self.processing.engine_inputs is not None:
            return self.processing.engine_inputs
        return self.inputs

    def engine_outputs(self) -> list[TensorSpec]:
        """What the engine gives: `processing.engine_outputs`, else the client outputs."""
        if self.processing is not None and self.processing.engine_outputs is not None:
            return self.processing.engine_outputs
        return self.outputs

    def engine_view(self) -> ModelConfig:
        """This config as the engine sees it (engine tensors, no processing; a
        sequence model's control and state tensors added).

        What the registry compares with the ONNX graph.
        """
        seq = self.sequence_batching
        if self.processing is None and seq is None:
            return self
        inputs, outputs = self.engine_inputs(), self.engine_outputs()
        if seq is not None:
            batched = self.max_batch_size > 0
            inputs = [*inputs, *seq.engine_inputs(batched)]
            outputs = [*outputs, *seq.engine_outputs(batched)]
        return self.model_copy(
            update={
                "inputs": inputs,
                "outputs": outputs,
                "processing": None,
                "sequence_batching": None,
            }
        )

    @model_validator(mode="after")
    def _batch_axis(self) -> ModelConfig:
        if self.max_batch_size > 0:
            for spec in [*self.inputs, *self.outputs]:
                if not spec.shape or spec.shape[0] != -1:
                    raise ValueError(
                        f"tensor '{spec.name}': with max_batch_size > 0 the first "
                        "dimension is the batch axis and must be -1"
                    )
        names = [s.name for s in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError("input names must be unique")
        labelled = [s.name for s in self.inputs if s.label_filename is not None]
        if labelled:
            raise ValueError(f"input(s) {labelled}: label_filename applies to outputs only")
        if self.fallback is not None and self.fallback.outputs is not None:
            known = {s.name for s in self.outputs}
            unknown = sorted(set(self.fallback.outputs) - known)
            if unknown:
                raise ValueError(f"fallback outputs {unknown} are not outputs of the model")
        return self

    def input_spec(self, name: str) -> TensorSpec | None:
        """The input called `name`, if any."""
        return next((s for s in self.inputs if s.name == name), None)

    def validate_request(self, tensors: Sequence[Tensor], outputs: Sequence[str] = ()) -> None:
        """Check a request's tensors against this config.

        Inputs must be exactly the model's inputs, with the right datatype,
        a shape that matches (``-1`` matches anything), a common batch size
        within `max_batch_size`, and raw data whose size matches the shape.
        BYTES inputs with `max_element_bytes` are checked too; with
        ``truncate`` their over-long elements are cut in place (the tensor's
        data is replaced), which is the one change this method makes.

        Raises:
            InvalidArgument: naming what is wrong and what was expected.
        """
        model = self.name or "model"
        given = {t.name for t in tensors}
        if len(given) != len(tensors):
            raise InvalidArgument(f"{model}: an input is given more than once")
        expected = [s.name for s in self.inputs]
        unknown = [t.name for t in tensors if t.name not in expected]
        if unknown:
            raise InvalidArgument(f"{model}: unknown input(s) {unknown}; expected {expected}")
        missing = [name for name in expected if name not in given]
        if missing:
            raise InvalidArgument(f"{model}: missing input(s) {missing}")
        batch: int | None = None
        for t in tensors:
            spec = self.input_spec(t.name)
            if spec is None:
                raise InvalidArgument(
                    f"{model}: unknown input '{t.name}'; expected {[s.name for s in self.inputs]}"
                )
            if t.datatype != spec.datatype:
                raise InvalidArgument(
                    f"{model}: input '{t.name}' has datatype {t.datatype}, expected {spec.datatype}"
                )
            if len(t.shape) != len(spec.shape) or any(
                want != -1 and got != want for got, want in zip(t.shape, spec.shape, strict=False)
            ):
                raise InvalidArgument(
                    f"{model}: input '{t.name}' has shape {list(t.shape)}, expected {spec.shape}"
                )
            if any(d < 0 for d in t.shape):
                raise InvalidArgument(f"{model}: input '{t.name}' has a negative dimension")
            if self.max_batch_size > 0:
                rows = t.shape[0]
                if batch is not None and rows != batch:
                    raise InvalidArgument(
                        f"{model}: inputs disagree on the batch size ({batch} vs {rows})"
                    )
                batch = rows
            check_raw_size(t.name, t.datatype, t.shape, t.data)
            if spec.max_element_bytes is not None:
                t.data = _limit_elements(model, t, spec.max_element_bytes, spec.truncate)
        if self.max_batch_size > 0 and batch is not None:
            if batch < 1:
                raise InvalidArgument(f"{model}: batch size must be at least 1")
            if batch > self.max_batch_size:
                raise InvalidArgument(
                    f"{model}: batch size {batch} exceeds max_batch_size {self.max_batch_size}"
                )
        known = {s.name for s in self.outputs}
        for name in outputs:
            if name not in known:
                raise InvalidArgument(f"{model}: unknown output '{name}'; expected {sorted(known)}")


def _limit_elements(model: str, t: Tensor, limit: int, truncate: bool) -> Buffer:
    """Enforce a BYTES input's longest element: cut (when allowed) or refuse."""
    items = deserialize_bytes(t.data)
    longest = max((len(x) for x in items), default=0)
    if longest <= limit:
        return t.data
    if not truncate:
        raise InvalidArgument(
            f"{model}: input '{t.name}' has an element of {longest} bytes; the limit is "
            f"{limit} bytes"
        )
    return serialize_bytes([x[:limit] for x in items])


def _check_decoupled(config: ModelConfig) -> None:
    """Check a decoupled model's responses axis against its outputs.

    Raises:
        ValueError: naming the output the axis does not fit.
    """
    dec = config.decoupled
    if dec is None:
        return
    if config.generative:
        raise ValueError("generative models are decoupled already; remove 'decoupled'")
    if config.sequence_batching is not None:
        raise ValueError("a model cannot be both decoupled and a sequence model")
    for spec in config.outputs:
        if dec.axis >= len(spec.shape):
            raise ValueError(
                f"decoupled.axis {dec.axis} is not an axis of output '{spec.name}' "
                f"(shape {spec.shape})"
            )
