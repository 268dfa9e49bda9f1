"""A model version's `config.json`: tensors, engine, batching, placement.

The same schema is validated by the registry at upload, read by the gateway
for request validation and metadata, by the batcher for its queue policy and
by the worker to build the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
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
from inferbus_common.datatypes import ALL_DATATYPES
from inferbus_common.engineconfig import EngineConfig, InstanceGroup, check_instance_group
from inferbus_common.errors import InvalidArgument
from inferbus_common.imageformat import Format, check_formats


class TensorSpec(BaseModel):
    """One input or output of a model. ``-1`` in `shape` means any size."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    datatype: str
    shape: list[int]
    max_element_bytes: int | None = Field(default=None, ge=1)
    """BYTES inputs only: the longest element accepted (e.g. text length)."""
    truncate: bool = False
    """BYTES inputs only: cut longer elements to `max_element_bytes` instead of
    refusing the request (a cleaning rule, like truncating over-long text)."""
    label_filename: str | None = None
    """Outputs only: labels file in the version directory (line i names class i),
    used by Triton's classification extension (``class_count`` on a requested
    output answers "score:index:label" strings of the top classes)."""
    format: Format | None = None
    """Inputs only: image layout (``FORMAT_NCHW``, ``FORMAT_NHWC``, ``FORMAT_NONE``),
    reported in Triton's model configuration; filled in at push where the shape
    makes it clear (`inferbus_common.imageformat`)."""

    @model_serializer(mode="wrap")
    def _omit_absent_labels(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out when unset, so configs without them dump (and hash) as before they existed.
        data: dict[str, Any] = handler(self)
        for key in ("label_filename", "format"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, v: str) -> str:
        if v not in ALL_DATATYPES:
            raise ValueError(f"unknown datatype {v!r}; expected one of {sorted(ALL_DATATYPES)}")
        return v

    @field_validator("label_filename")
    @classmethod
    def _relative_file(cls, v: str | None) -> str | None:
        if v is not None and (not v or v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"label_filename {v!r} must be a path inside the version directory")
        return v

    @model_validator(mode="after")
    def _bytes_rules(self) -> TensorSpec:
        if (self.max_element_bytes is not None or self.truncate) and self.datatype != "BYTES":
            raise ValueError(f"'{self.name}': max_element_bytes/truncate apply to BYTES only")
        if self.truncate and self.max_element_bytes is None:
            raise ValueError(f"'{self.name}': truncate needs max_element_bytes")
        return self

    @field_validator("shape")
    @classmethod
    def _dims(cls, v: list[int]) -> list[int]:
        if any(d < -1 or d == 0 for d in v):
            raise ValueError(f"shape {v}: dimensions must be positive or -1")
        return v


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
    max_waiting: int = Field(default=8, ge=0)
    """Requests a worker accepts beyond `max_num_seqs` (queued in the engine);
    more than ``max_num_seqs + max_waiting`` in flight → RESOURCE_EXHAUSTED at once."""
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


class TokenizeStep(BaseModel):
    """Pre-processing: text → token ids with a `tokenizers` ``tokenizer.json``.

    The client sends one UTF-8 text per row (a BYTES input of shape ``[-1]`` or
    ``[-1, 1]``); the engine gets INT64 ``ids`` (and ``mask`` when named) of
    shape ``[-1, max_length]``, truncated and padded with ``pad_id``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tokenize"]
    input: str = Field(min_length=1)
    """Client-facing BYTES input holding the texts."""
    tokenizer: str = "tokenizer.json"
    """Tokenizer file inside the version directory."""
    max_length: int = Field(ge=1, le=1 << 16)
    """Every row is truncated or padded to exactly this many tokens."""
    ids: str = "input_ids"
    """Engine-facing INT64 input receiving the token ids."""
    mask: str | None = "attention_mask"
    """Engine-facing INT64 input receiving the attention mask (None: not produced)."""
    pad_id: int = Field(default=0, ge=0)
    """Token id used for padding."""

    def produces(self) -> dict[str, tuple[str, list[int]]]:
        """Engine inputs this step writes: name → (datatype, shape)."""
        out = {self.ids: ("INT64", [-1, self.max_length])}
        if self.mask:
            out[self.mask] = ("INT64", [-1, self.max_length])
        return out


class ImageStep(BaseModel):
    """Pre-processing: images → a normalised FP32 tensor.

    The client sends either UINT8 pixels ``[-1, H, W, C]`` (any size, resized
    here) or encoded images (PNG, JPEG, ...) as a BYTES input of shape ``[-1]``
    or ``[-1, 1]``. Each image is resized to `height` x `width` (bilinear),
    then ``(pixel * scale - mean) / std`` per channel, laid out as `layout`.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["image"]
    input: str = Field(min_length=1)
    """Client-facing UINT8 or BYTES input."""
    output: str = Field(min_length=1)
    """Engine-facing FP32 input."""
    height: int = Field(ge=1, le=16384)
    width: int = Field(ge=1, le=16384)
    channels: Literal[1, 3] = 3
    """1: grayscale (PIL mode ``L``), 3: RGB."""
    scale: float = 1.0 / 255.0
    mean: list[float] = Field(default_factory=lambda: [0.0])
    """Per-channel mean (one value applies to every channel)."""
    std: list[float] = Field(default_factory=lambda: [1.0])
    """Per-channel standard deviation (one value applies to every channel)."""
    layout: Literal["NCHW", "NHWC"] = "NCHW"

    @model_validator(mode="after")
    def _channels(self) -> ImageStep:
        for field_name in ("mean", "std"):
            values = getattr(self, field_name)
            if len(values) not in (1, self.channels):
                raise ValueError(
                    f"image step '{self.input}': {field_name} needs 1 or {self.channels} values, "
                    f"got {len(values)}"
                )
        if any(s == 0 for s in self.std):
            raise ValueError(f"image step '{self.input}': std must not contain 0")
        return self

    def output_shape(self) -> list[int]:
        """Shape of the produced tensor, batch axis first."""
        if self.layout == "NCHW":
            return [-1, self.channels, self.height, self.width]
        return [-1, self.height, self.width, self.channels]

    def produces(self) -> dict[str, tuple[str, list[int]]]:
        """Engine inputs this step writes: name → (datatype, shape)."""
        return {self.output: ("FP32", self.output_shape())}


class SoftmaxStep(BaseModel):
    """Post-processing: softmax over the last axis (numerically stable, FP32)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["softmax"]
    input: str = Field(min_length=1)
    """Tensor to normalise (an engine output or an earlier step's output)."""
    output: str | None = None
    """Name of the result; None replaces `input`."""

    def produces(self) -> dict[str, str]:
        """Tensors this step writes: name → datatype."""
        return {self.output or self.input: "FP32"}


class TopKStep(BaseModel):
    """Post-processing: the `k` best classes of each row, best first.

    Writes FP32 `scores` ``[-1, k]`` and, with a `labels` file (one label per
    line, line i naming class i), BYTES `labels_output` ``[-1, k]``; the class
    indexes too when `indices` is named.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["topk"]
    input: str = Field(min_length=1)
    """Scores per class, ``[-1, classes]``."""
    k: int = Field(default=1, ge=1)
    labels: str | None = "labels.txt"
    """Labels file inside the version directory (None: no label output)."""
    labels_output: str = "label"
    scores: str = "score"
    indices: str | None = None
    """INT64 output with the class indexes (None: not produced)."""

    def produces(self) -> dict[str, str]:
        """Tensors this step writes: name → datatype."""
        out = {self.scores: "FP32"}
        if self.labels:
            out[self.labels_output] = "BYTES"
        if self.indices:
            out[self.indices] = "INT64"
        return out


PreStep = Annotated[TokenizeStep | ImageStep, Field(discriminator="kind")]
PostStep = Annotated[SoftmaxStep | TopKStep, Field(discriminator="kind")]


class ProcessingConfig(BaseModel):
    """Pre/post-processing the worker runs around the engine, on the whole micro-batch.

    The model's `inputs`/`outputs` stay what clients send and get (the gateway
    and the batcher validate those); `engine_inputs`/`engine_outputs` are what
    the engine (the ONNX graph) takes and gives. Client inputs no pre step
    consumes are handed to the engine unchanged, so they must be engine inputs
    too; client outputs must exist after the post steps ran.
    """

    model_config = ConfigDict(extra="forbid")

    pre: list[PreStep] = Field(default_factory=list)
    post: list[PostStep] = Field(default_factory=list)
    engine_inputs: list[TensorSpec] | None = None
    """Required with `pre` steps; None means the same as the client inputs."""
    engine_outputs: list[TensorSpec] | None = None
    """Required with `post` steps; None means the same as the client outputs."""

    def files(self) -> list[str]:
        """Files of the version directory the steps read (tokenizers, labels)."""
        out: list[str] = []
        for step in self.pre:
            if isinstance(step, TokenizeStep):
                out.append(step.tokenizer)
        for post_step in self.post:
            if isinstance(post_step, TopKStep) and post_step.labels:
                out.append(post_step.labels)
        return sorted(set(out))


_CONTROL_DATATYPES = {
    "start": ("INT32", "FP32", "BOOL"),
    "end": ("INT32", "FP32", "BOOL"),
    "ready": ("INT32", "FP32", "BOOL"),
    "corrid": ("UINT64", "INT64", "BYTES"),
}
"""Datatypes each control kind may have (Triton's int32/fp32/bool false_true; the
correlation id as an integer or a string)."""


class SequenceControl(BaseModel):
    """A control input the worker fills in for every request of a sequence.

    Triton's ``sequence_batching.control_input``: the model gets it as an
    input, clients never send it. ``start``/``end`` are true on the first/last
    request of a sequence, ``ready`` on every row that holds a request,
    ``corrid`` is the sequence id.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["start", "end", "ready", "corrid"]
    name: str = Field(min_length=1)
    """Input name in the model."""
    datatype: str = "INT32"
    """``start``/``end``/``ready``: INT32, FP32 or BOOL; ``corrid``: UINT64, INT64
    or BYTES (a string id; an integer id is sent as its decimal text)."""
    false_true: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    """The values meaning false and true (not for ``corrid``)."""

    @model_validator(mode="after")
    def _datatype_fits(self) -> SequenceControl:
        allowed = _CONTROL_DATATYPES[self.kind]
        if self.datatype not in allowed:
            raise ValueError(
                f"control '{self.name}' ({self.kind}) must be one of {list(allowed)}, "
                f"not {self.datatype}"
            )
        if len(self.false_true) != 2:
            raise ValueError(f"control '{self.name}': false_true needs two values")
        return self


class SequenceState(BaseModel):
    """Implicit state: an output fed back as an input on the sequence's next request.

    Triton's ``sequence_batching.state``. The worker keeps one value per
    sequence, zeros on the sequence's first request (``initial_state``
    ``zero_data``), and replaces it with `output` after each request. Clients
    never see either tensor.
    """

    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1)
    """Model input receiving the state."""
    output: str = Field(min_length=1)
    """Model output holding the next state."""
    datatype: str
    shape: list[int] = Field(min_length=1)
    """Shape of one sequence's state (without the batch axis); fixed sizes."""

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, v: str) -> str:
        if v not in ALL_DATATYPES or v == "BYTES":
            raise ValueError(f"state datatype {v!r} must be a numeric or BOOL datatype")
        return v

    @field_validator("shape")
    @classmethod
    def _fixed(cls, v: list[int]) -> list[int]:
        if any(d < 1 for d in v):
            raise ValueError(f"state shape {v} must have fixed, positive dimensions")
        return v


class SequenceBatchingConfig(BaseModel):
    """A stateful model: Triton's sequence batcher (docs/architecture.md, "Sequences").

    Every request must carry a ``sequence_id``; all requests of one sequence
    are computed, in order, by the one worker its first request (``sequence_start``)
    landed on, which keeps its state. Requests of different sequences that are
    ready at the same time run as one batch (Triton's ``oldest`` strategy),
    one row each.
    """

    model_config = ConfigDict(extra="forbid")

    max_sequence_idle_us: int = Field(default=1_000_000, ge=1000)
    """A sequence without a request for this long is freed with its state
    (Triton's ``max_sequence_idle_microseconds``; 1 s by default, as Triton's)."""
    max_sequences: int = Field(default=256, ge=1)
    """Sequences one worker holds at once; a start beyond it is RESOURCE_EXHAUSTED
    (Triton's ``max_candidate_sequences``)."""
    max_queue_delay_us: int = Field(default=0, ge=0)
    """How long a ready request may wait for requests of other sequences to fill
    a batch (0: run what is ready at once)."""
    controls: list[SequenceControl] = Field(default_factory=list)
    states: list[SequenceState] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> SequenceBatchingConfig:
        kinds = [c.kind for c in self.controls]
        if len(set(kinds)) != len(kinds):
            raise ValueError("sequence_batching.controls: each kind at most once")
        names = [c.name for c in self.controls] + [s.input for s in self.states]
        if len(set(names)) != len(names):
            raise ValueError("sequence_batching: control and state input names must be unique")
        outs = [s.output for s in self.states]
        if len(set(outs)) != len(outs):
            raise ValueError("sequence_batching.states: output names must be unique")
        return self

    def engine_inputs(self, batched: bool) -> list[TensorSpec]:
        """The inputs the worker adds to a request (controls, then states)."""
        lead = [-1] if batched else []
        out = [
            TensorSpec(name=c.name, datatype=c.datatype, shape=[*lead, 1]) for c in self.controls
        ]
        out += [
            TensorSpec(name=s.input, datatype=s.datatype, shape=[*lead, *s.shape])
            for s in self.states
        ]
        return out

    def engine_outputs(self, batched: bool) -> list[TensorSpec]:
        """The state outputs the worker takes from each run."""
        lead = [-1] if batched else []
        return [
            TensorSpec(name=s.output, datatype=s.datatype, shape=[*lead, *s.shape])
            for s in self.states
        ]


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
        _check_processing(self)
        _check_sequences(self)
        _check_decoupled(self)
        check_instance_group(self)
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


def _shape_fits(spec_shape: list[int], shape: list[int]) -> bool:
    """Whether a declared shape admits a produced one (-1 on either side matches)."""
    return len(spec_shape) == len(shape) and all(
        a == -1 or b == -1 or a == b for a, b in zip(spec_shape, shape, strict=True)
    )


def _check_processing(config: ModelConfig) -> None:
    """Check the processing section is consistent with the model's tensors.

    Raises:
        ValueError: naming the step or tensor that does not fit (pydantic
            turns it into the config's validation error).
    """
    proc = config.processing
    if proc is None:
        return
    if (proc.pre or proc.post) and config.max_batch_size <= 0:
        raise ValueError("processing steps run per row: they need max_batch_size > 0")
    if proc.pre and proc.engine_inputs is None:
        raise ValueError("processing.pre needs processing.engine_inputs (what the engine takes)")
    if proc.post and proc.engine_outputs is None:
        raise ValueError("processing.post needs processing.engine_outputs (what the engine gives)")
    client_in = {s.name: s for s in config.inputs}
    engine_in = {s.name: s for s in config.engine_inputs()}
    engine_out = {s.name: s for s in config.engine_outputs()}
    if len(engine_in) != len(config.engine_inputs()):
        raise ValueError("processing.engine_inputs names must be unique")
    if len(engine_out) != len(config.engine_outputs()):
        raise ValueError("processing.engine_outputs names must be unique")
    if config.max_batch_size > 0:
        for tensor in [*config.engine_inputs(), *config.engine_outputs()]:
            if not tensor.shape or tensor.shape[0] != -1:
                raise ValueError(
                    f"engine tensor '{tensor.name}': with max_batch_size > 0 the first "
                    "dimension is the batch axis and must be -1"
                )
    consumed: set[str] = set()
    produced: dict[str, tuple[str, list[int]]] = {}
    for step in proc.pre:
        where = f"processing.pre {step.kind} step"
        src = client_in.get(step.input)
        if src is None:
            raise ValueError(
                f"{where}: input '{step.input}' is not a model input; inputs: {sorted(client_in)}"
            )
        if step.input in consumed:
            raise ValueError(f"{where}: input '{step.input}' is consumed by two steps")
        consumed.add(step.input)
        one_per_row = src.datatype == "BYTES" and src.shape in ([-1], [-1, 1])
        if isinstance(step, TokenizeStep) and not one_per_row:
            raise ValueError(
                f"{where}: input '{step.input}' must be BYTES with shape [-1] or [-1, 1] "
                f"(one text per row), not {src.datatype} {src.shape}"
            )
        if isinstance(step, ImageStep):
            pixels = src.datatype == "UINT8" and len(src.shape) == 4
            if not (pixels or one_per_row):
                raise ValueError(
                    f"{where}: input '{step.input}' must be UINT8 [-1, H, W, C] pixels or "
                    f"BYTES [-1] encoded images, not {src.datatype} {src.shape}"
                )
            if pixels and src.shape[3] not in (-1, 1, 3, 4):
                raise ValueError(
                    f"{where}: input '{step.input}' has {src.shape[3]} channels; "
                    "expected 1 (gray), 3 (RGB) or 4 (RGBA)"
                )
        for name, value in step.produces().items():
            if name in produced or (name in client_in and name not in consumed):
                raise ValueError(f"{where}: tensor '{name}' is written twice")
            produced[name] = value
    for name, (datatype, shape) in produced.items():
        spec = engine_in.get(name)
        if spec is None:
            raise ValueError(
                f"processing.pre writes '{name}' but it is not in processing.engine_inputs "
                f"{sorted(engine_in)}"
            )
        if spec.datatype != datatype or not _shape_fits(spec.shape, shape):
            raise ValueError(
                f"processing.engine_inputs '{name}' is {spec.datatype} {spec.shape} but the "
                f"pre step writes {datatype} {shape}"
            )
    for name, spec in engine_in.items():
        if name in produced:
            continue
        src = client_in.get(name)
        if src is None or name in consumed:
            raise ValueError(
                f"engine input '{name}' is neither written by a pre step nor a model input "
                "passed through unchanged"
            )
        if src.datatype != spec.datatype or src.shape != spec.shape:
            raise ValueError(
                f"input '{name}' passes through to the engine but is {src.datatype} {src.shape} "
                f"for clients and {spec.datatype} {spec.shape} for the engine"
            )
    unused = sorted(set(client_in) - consumed - set(engine_in))
    if unused:
        raise ValueError(f"model input(s) {unused} are neither pre-processed nor engine inputs")
    tensors = {name: spec.datatype for name, spec in engine_out.items()}
    for post_step in proc.post:
        where = f"processing.post {post_step.kind} step"
        in_type = tensors.get(post_step.input)
        if in_type is None:
            raise ValueError(
                f"{where}: '{post_step.input}' is not an engine output or an earlier step's "
                f"output; available: {sorted(tensors)}"
            )
        if in_type not in ("FP16", "FP32", "FP64"):
            raise ValueError(f"{where}: '{post_step.input}' is {in_type}; it needs floating point")
        tensors.update(post_step.produces())
    topk_shapes = {
        name: [-1, step.k]
        for step in proc.post
        if isinstance(step, TopKStep)
        for name in step.produces()
    }
    for spec in config.outputs:
        if spec.name in topk_shapes and not _shape_fits(spec.shape, topk_shapes[spec.name]):
            raise ValueError(
                f"model output '{spec.name}' has shape {spec.shape} but top-k writes "
                f"{topk_shapes[spec.name]}"
            )
        out_type = tensors.get(spec.name)
        if out_type is None:
            raise ValueError(
                f"model output '{spec.name}' is neither an engine output nor written by a post "
                f"step; available: {sorted(tensors)}"
            )
        if out_type != spec.datatype:
            raise ValueError(
                f"model output '{spec.name}' is {spec.datatype} in outputs but {out_type} "
                "after processing"
            )


def _check_sequences(config: ModelConfig) -> None:
    """Check a sequence model's section against its tensors.

    Raises:
        ValueError: naming what does not fit.
    """
    seq = config.sequence_batching
    if seq is None:
        return
    if config.generative:
        raise ValueError("sequence_batching applies to tensor models, not generative ones")
    if config.processing is not None:
        raise ValueError("sequence_batching cannot be combined with processing steps")
    if config.fallback is not None:
        raise ValueError(
            "sequence_batching cannot have a fallback: a fallback answer would hide a "
            "sequence whose state is lost"
        )
    clients = {s.name for s in config.inputs} | {s.name for s in config.outputs}
    added = [c.name for c in seq.controls] + [s.input for s in seq.states]
    added += [s.output for s in seq.states]
    clash = sorted(clients.intersection(added))
    if clash:
        raise ValueError(
            f"sequence_batching tensor(s) {clash} are also model inputs/outputs; controls "
            "and states are filled in by the worker and must not be listed there"
        )


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
