"""A stateful model's section (`SequenceBatchingConfig`): controls and states.

Triton's sequence batcher as `config.json` declares it, and `check_sequences`,
which checks it against a `ModelConfig`'s tensors (`inferbus_common.modelconfig`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferbus_common.datatypes import ALL_DATATYPES
from inferbus_common.tensorspec import TensorSpec

if TYPE_CHECKING:
    from inferbus_common.modelconfig import ModelConfig


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


def check_sequences(config: ModelConfig) -> None:
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
