"""The generative request and its streamed chunks, as they travel on NATS.

Gateway → router → LLM worker: one message on ``ib.genroute.<model>`` whose
body is a `GenerationRequest` as JSON and whose headers are the usual ones
(`Ib-Request-Id`, `Ib-Deadline`, `Ib-Model`, `Ib-Reply`, `Ib-Tenant`,
`traceparent`, ``Ib-Kind: generate``); the router sends it to
``ib.gen.<model>.<version>``, never to the batcher.

LLM worker → gateway inbox: a stream of chunk messages, each with
``Ib-Seq`` (0, 1, 2 ...) and a JSON `GenerationChunk` body; the last one has
``Ib-Final: 1``. An error is a chunk with ``Ib-Status``/``Ib-Error`` (see
`inferbus_common.protocol.replies`) and an empty body, and is always final. NATS core
does not reorder messages from one publisher, but a stream may still lose one
(a slow consumer): the gateway reorders within a small window and fails the
stream cleanly on a gap.

Chunk frames: a gateway that puts ``Ib-Chunk-Frames: <subject>`` on the request
takes that request's plain chunks (no error) framed: the worker packs the chunks
one engine step made for all the streams of that gateway into one message on
``<subject>`` (`pack_chunk`, `unpack_chunks`; ``Ib-Version`` once, in its
headers), instead of one message per stream and step. Errors still travel as
single messages, after whatever frame was pending.

Gateway → every LLM worker: an empty message on ``<prefix>.gencancel.<request
id>`` (`Subjects.gen_cancel`) when the client went away or the deadline passed;
the worker holding that request aborts it in the engine (its KV cache is freed).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from inferbus_common.errors import InferbusError, InvalidArgument, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    from inferbus_common.catalog import Catalog

LLM_FULL_REASON = "llm-full"
"""`ResourceExhausted.reason` when every worker of a generative version holds as many
requests as it admits (``max_num_seqs + max_waiting``)."""
LLM_LATE_REASON = "llm-late"
"""`ResourceExhausted.reason` when a request would wait at the worker and, by its recent
timings, end past its deadline (`inferbus_worker.llm.capacity`)."""


def no_generation_worker(catalog: Catalog, model: str, version: str) -> InferbusError:
    """The answer to a generative request that no LLM worker took (nats-server's "no
    responders" on the version's subject): 429 ``llm-full`` when the catalog shows
    ready workers for the version (each leaves the queue group while full), else 503
    naming the version's state. Nothing was generated either way.
    """
    ready = len(catalog.ready_workers(model, version))
    if ready:
        return ResourceExhausted(
            f"model '{model}' version '{version}': all {ready} worker(s) serving it hold "
            "as many requests as they admit (max_num_seqs + max_waiting); nothing was "
            "generated, retry later or add workers",
            reason=LLM_FULL_REASON,
            retry_after_s=1.0,
        )
    return Unavailable(
        f"no worker is taking generation requests for model '{model}' version "
        f"'{version}' ({catalog.version_state(model, version)}); nothing was generated, "
        "safe to retry"
    )


MAX_CHOICES = 16
"""Most completions one request may ask for (``n``)."""
MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (vLLM's default ``max_logprobs``)."""


def text_of_parts(parts: list[Any]) -> str:
    """The text of an OpenAI content-part list, text parts joined by newlines (as vLLM does).

    Raises:
        ValueError: a part that is not ``{"type": "text", "text": str}``; the
            message names the part's type (inferbus carries text only: images,
            audio and files reach no model).
    """
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(
                f"content part {i} has type {kind!r}: only 'text' parts are supported "
                "(the generative models served here take text only)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {i} (type 'text') needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


class ChatMessage(BaseModel):
    """One chat turn (OpenAI's message shape, text only).

    ``content`` may come as a string or as a list of text parts
    (``[{"type": "text", "text": ...}]``); it travels as one string.
    """

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = ""
    name: str | None = None
    """The participant's name; handed to the chat template."""

    @field_validator("content", mode="before")
    @classmethod
    def _content_text(cls, value: Any) -> Any:
        if value is None:  # an assistant turn may have no content
            return ""
        if isinstance(value, list):
            return text_of_parts(value)
        return value


class ResponseFormat(BaseModel):
    """Structured output: what the completion must parse as (vLLM's structured outputs).

    ``json_object``: any JSON object; ``json_schema``: JSON valid against `json_schema`.
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """The JSON Schema (for ``json_schema`` only)."""

    @model_validator(mode="after")
    def _schema_matches_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a schema")
        if self.type == "json_object" and self.json_schema is not None:
            raise ValueError("type 'json_object' takes no schema")
        return self


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
    top_k: int = Field(default=0, ge=-1)
    """Sample from the k likeliest tokens only; 0 or -1: all (vLLM's extension)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Drop tokens less likely than this share of the likeliest (vLLM's extension)."""
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)
    """Above 1 discourages tokens already in prompt or output (vLLM's extension)."""
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Completions to generate for the prompt (chunks carry their `GenerationChunk.index`)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """None: no log probabilities; k: each token's, with its k likeliest alternatives."""
    response_format: ResponseFormat | None = None
    """Constrain the completion to JSON (vLLM's structured outputs)."""

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
class TokenLogprob:
    """One generated token's log probability and its likeliest alternatives.

    Attributes:
        token: the token's text.
        logprob: its log probability (-9999.0 stands for minus infinity, as in vLLM).
        top: ``(token, logprob)`` of the most likely tokens at that position,
            likeliest first (as many as the request's ``logprobs``).
    """

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenerationChunk:
    """One streamed piece of one completion (a request with ``n`` > 1 has several).

    Attributes:
        text: text generated since the previous chunk of this completion (may be empty).
        tokens: tokens generated since the previous chunk of this completion.
        index: which of the request's ``n`` completions this piece belongs to.
        logprobs: one `TokenLogprob` per token of the piece, when the request
            asked for them (None otherwise).
        finish_reason: set on the chunk that ends its completion (with ``n`` = 1,
            the final chunk).
        prompt_tokens: on the final chunk: tokens in the (templated) prompt.
        completion_tokens: on the final chunk: tokens generated in total (all
            completions together).
        timings_ms: on the final chunk: ``queue`` (arrival to scheduled),
            ``ttft`` (arrival to first token), ``total`` (at the worker).
    """

    text: str = ""
    tokens: int = 0
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)

    def encode(self) -> bytes:
        """JSON body of the chunk message (orjson writes the dataclass itself)."""
        return orjson.dumps(self)

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
        if known.get("logprobs") is not None:
            known["logprobs"] = [
                TokenLogprob(lp["token"], lp["logprob"], [(t, v) for t, v in lp.get("top", [])])
                for lp in known["logprobs"]
            ]
        return cls(**known)


_ENTRY = struct.Struct("<HIBI")
"""A framed chunk's head: reply subject length, sequence number, final flag, body length."""


def pack_chunk(reply: str, seq: int, final: bool, body: bytes) -> bytes:
    """One chunk as an entry of a chunk frame (concatenate entries to make a frame)."""
    subject = reply.encode()
    return _ENTRY.pack(len(subject), seq, 1 if final else 0, len(body)) + subject + body


def unpack_chunks(frame: bytes) -> Iterator[tuple[str, int, bool, bytes]]:
    """The ``(reply subject, sequence number, final, body)`` of each entry of a frame.

    Raises:
        ValueError: a truncated or malformed frame.
    """
    view = memoryview(frame)
    pos, end = 0, len(frame)
    head = _ENTRY.size
    while pos < end:
        if end - pos < head:
            raise ValueError("a chunk frame ends inside an entry's head")
        n_subject, seq, final, n_body = _ENTRY.unpack_from(view, pos)
        pos += head
        if end - pos < n_subject + n_body:
            raise ValueError("a chunk frame ends inside an entry")
        reply = str(view[pos : pos + n_subject], "utf-8")
        pos += n_subject
        yield reply, seq, final == 1, bytes(view[pos : pos + n_body])
        pos += n_body
