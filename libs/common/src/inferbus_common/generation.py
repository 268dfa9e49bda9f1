"""The generative request and its streamed chunks, as they travel on NATS.

Gateway → router → LLM worker: one message whose body is a `GenerationRequest`
as JSON and whose headers are the usual ones (`Ib-Request-Id`, `Ib-Deadline`,
`Ib-Model`, `Ib-Reply`, `Ib-Tenant`, `traceparent`) plus ``Ib-Kind: generate``,
which makes the router send it to ``ib.gen.<model>.<version>`` instead of the
batcher.

LLM worker → gateway inbox: a stream of chunk messages, each with
``Ib-Seq`` (0, 1, 2 ...) and a JSON `GenerationChunk` body; the last one has
``Ib-Final: 1``. An error is a chunk with ``Ib-Status``/``Ib-Error`` (see
`inferbus_common.protocol.replies`) and an empty body, and is always final. NATS core
does not reorder messages from one publisher, but a stream may still lose one
(a slow consumer): the gateway reorders within a small window and fails the
stream cleanly on a gap.

Gateway → every LLM worker: an empty message on ``<prefix>.gencancel.<request
id>`` (`Subjects.gen_cancel`) when the client went away or the deadline passed;
the worker holding that request aborts it in the engine (its KV cache is freed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferbus_common.errors import InvalidArgument

LLM_FULL_REASON = "llm-full"
"""`ResourceExhausted.reason` when every worker of a generative version holds as many
requests as it admits (``max_num_seqs + max_waiting``)."""


class ChatMessage(BaseModel):
    """One chat turn (OpenAI's message shape; only text content)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = ""


class GenerationRequest(BaseModel):
    """What to generate: a chat (the worker applies the model's chat template) or a
    raw prompt, and the sampling parameters the OpenAI API exposes."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["chat", "completion"]
    messages: list[ChatMessage] = Field(default_factory=list)
    prompt: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    """Completion length limit; None: the model's ``generation.default_max_tokens``."""
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (vLLM's extension; benchmarks)."""

    @model_validator(mode="after")
    def _has_input(self) -> GenerationRequest:
        if self.kind == "chat" and not self.messages:
            raise ValueError("a chat request needs at least one message")
        return self

    def encode(self) -> bytes:
        """JSON body of the bus message."""
        return orjson.dumps(self.model_dump(mode="json", exclude_defaults=True))

    @classmethod
    def decode(cls, data: bytes) -> GenerationRequest:
        """Parse a bus message body.

        Raises:
            InvalidArgument: not JSON, or not a valid request.
        """
        try:
            return cls.model_validate(orjson.loads(data))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise InvalidArgument(f"malformed generation request: {exc}") from None


FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class GenerationChunk:
    """One streamed piece of a completion.

    Attributes:
        text: text generated since the previous chunk (may be empty).
        tokens: tokens generated since the previous chunk.
        finish_reason: set on the final chunk only.
        prompt_tokens: on the final chunk: tokens in the (templated) prompt.
        completion_tokens: on the final chunk: tokens generated in total.
        timings_ms: on the final chunk: ``queue`` (arrival to scheduled),
            ``ttft`` (arrival to first token), ``total`` (at the worker).
    """

    text: str = ""
    tokens: int = 0
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)

    def encode(self) -> bytes:
        """JSON body of the chunk message."""
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> GenerationChunk:
        """Parse a chunk body.

        Raises:
            ValueError: not a chunk.
        """
        raw = orjson.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("a generation chunk must be a JSON object")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)
