"""A model version's `config.json`: tensors, engine, batching, placement.

The same schema is validated by the registry at upload, read by the gateway
for request validation and metadata, by the batcher for its queue policy and
by the worker to build the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferbus_common.codec import Tensor, check_raw_size, deserialize_bytes, serialize_bytes
from inferbus_common.datatypes import ALL_DATATYPES
from inferbus_common.errors import InvalidArgument


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

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, v: str) -> str:
        if v not in ALL_DATATYPES:
            raise ValueError(f"unknown datatype {v!r}; expected one of {sorted(ALL_DATATYPES)}")
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


class EngineConfig(BaseModel):
    """Which engine runs the model and how."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    providers: list[Literal["cpu", "cuda", "tensorrt"]] = Field(default_factory=lambda: ["cpu"])
    """Execution providers in order of preference; the worker uses what it has."""
    intra_op_threads: int = Field(default=1, ge=0)
    inter_op_threads: int = Field(default=1, ge=0)


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
    """Concurrent executions of the model per worker."""
    pool: str = "default"
    """Worker pool the version is placed on."""
    fallback: FallbackConfig | None = None
    """Degraded answer used by the gateway when the model cannot answer; None: none."""

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


def _limit_elements(model: str, t: Tensor, limit: int, truncate: bool) -> bytes | memoryview:
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
