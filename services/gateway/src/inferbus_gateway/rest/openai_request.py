"""An OpenAI request body → a `GenerationRequest`, with every field accounted for.

Each field the OpenAI API (or vLLM's server) accepts is one of three things
here, per endpoint:

- *served*: turned into the request (`GenerationRequest`) or into how it is
  answered (``stream``, ``stream_options``);
- *inert*: accepted only at the value that asks for nothing (``echo: false``,
  ``tools: []``, ``logit_bias: {}`` ...), or a field that by OpenAI's own
  definition does not change the answer (``user``, ``safety_identifier``,
  ``prompt_cache_key``, ``metadata``);
- anything else: refused with 400 naming the field (``param`` in the error
  body), never accepted and ignored.

The audit lives in `_INERT` and the ``_SERVED_*`` sets: a field the API grows
is refused until it is added to one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from inferbus_common.errors import InvalidArgument
from inferbus_common.generation import MAX_LOGPROBS, GenerationRequest, ResponseFormat


class InvalidField(InvalidArgument):
    """A request field the gateway refuses; `param` names it (OpenAI's ``error.param``).

    Args:
        param: the field (dotted for nested ones, e.g. ``messages.0.content``).
        message: what the client reads.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A parsed OpenAI request.

    Attributes:
        model: the model asked for.
        request: what the worker generates.
        stream: answer with server-sent events.
        include_usage: end a stream with a ``usage`` chunk.
    """

    model: str
    request: GenerationRequest
    stream: bool
    include_usage: bool


# Sampling fields carried as they are (names shared by the request and the body).
_SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "top_k",
    "min_p",
    "repetition_penalty",
    "n",
)
_SERVED_COMMON = frozenset(
    {"model", "max_tokens", "stop", "stream", "stream_options", "logprobs", "response_format"}
    | set(_SAMPLING)
)
_SERVED = {
    "chat": _SERVED_COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
    "completion": _SERVED_COMMON | {"prompt"},
}


def _always(_value: Any) -> bool:
    return True


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


_INERT: dict[str, Callable[[Any], bool]] = {
    # Do not change the answer (abuse monitoring, cache routing, labels).
    "user": _always,
    "safety_identifier": _always,
    "prompt_cache_key": _always,
    "metadata": _always,
    "parallel_tool_calls": _always,  # meaningful only with tools, which are refused
    "store": _one_of(False),
    "service_tier": _one_of("auto", "default"),
    "modalities": _one_of(["text"]),
    "tools": _empty,
    "functions": _empty,
    "tool_choice": _one_of("none", "auto"),
    "function_call": _one_of("none", "auto"),
    "logit_bias": _empty,
    "audio": _empty,
    "prediction": _empty,
    "reasoning_effort": _empty,
    "verbosity": _empty,
    "web_search_options": _empty,
    "echo": _one_of(False),
    "suffix": _empty,
    "best_of": _one_of(1),
    # vLLM's extensions, at their defaults.
    "min_tokens": _one_of(0),
    "include_stop_str_in_output": _one_of(False),
    "skip_special_tokens": _one_of(True),
    "spaces_between_special_tokens": _one_of(True),
    "stop_token_ids": _empty,
    "add_generation_prompt": _one_of(True),
    "continue_final_message": _one_of(False),
    "add_special_tokens": _empty,
    "chat_template": _empty,
    "chat_template_kwargs": _empty,
    "structured_outputs": _empty,
    "priority": _one_of(0),
    "request_id": _empty,
}
"""Fields accepted only where the predicate holds (their value asks for nothing)."""

_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
_MESSAGE_INERT = frozenset({"tool_calls", "function_call", "refusal", "audio", "annotations"})
"""Message fields an SDK echoes back from a previous answer: accepted when empty."""
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})


def _audit(body: dict[str, Any], kind: str) -> None:
    """Refuse any field that is neither served nor inert at its value."""
    served = _SERVED[kind]
    for name, value in body.items():
        if name in served:
            continue
        inert = _INERT.get(name)
        if inert is None:
            raise InvalidField(name, f"unknown field '{name}'")
        if not inert(value):
            raise InvalidField(
                name, f"'{name}' is not supported here (value {value!r}); leave it out"
            )


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return value
    raise InvalidField("stop", "'stop' must be a string or a list of non-empty strings")


def _messages(value: Any) -> Any:
    """The messages with the fields an SDK sends back empty dropped; others refused."""
    if not isinstance(value, list):
        return value  # the model's validation says what is wrong
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            out.append(message)
            continue
        kept = {}
        for name, field_value in message.items():
            if name in _MESSAGE_FIELDS:
                kept[name] = field_value
            elif name in _MESSAGE_INERT and _empty(field_value):
                continue
            else:
                raise InvalidField(
                    f"messages.{i}.{name}",
                    f"messages[{i}].{name} is not supported (text chat only: no tool "
                    "calls, audio or refusals)",
                )
        out.append(kept)
    return out


def _bounded_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidField(name, f"'{name}' must be an integer from {low} to {high}")
    return value


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """The number of alternatives per token (None: no log probabilities).

    Completions: ``logprobs`` is that number. Chat: ``logprobs`` is a flag and
    ``top_logprobs`` the number (it needs ``logprobs: true``).
    """
    value = body.get("logprobs")
    if kind == "completion":
        return None if value is None else _bounded_int("logprobs", value, 0, MAX_LOGPROBS)
    if value is not None and not isinstance(value, bool):
        raise InvalidField("logprobs", "'logprobs' must be true or false for chat")
    top = body.get("top_logprobs")
    if top is not None:
        top = _bounded_int("top_logprobs", top, 0, MAX_LOGPROBS)
    if not value:
        if top:
            raise InvalidField("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def _response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidField(
                "response_format.json_schema",
                "response_format type 'json_schema' needs json_schema.schema (a JSON Schema)",
            )
        return ResponseFormat(type="json_schema", json_schema=schema)
    raise InvalidField(
        "response_format.type",
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
    )


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether to end the stream with usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidField("stream_options", "'stream_options' needs 'stream': true")
    if not isinstance(options, dict):
        raise InvalidField("stream_options", "'stream_options' must be an object")
    for name in options:
        if name not in _STREAM_OPTIONS:
            raise InvalidField(f"stream_options.{name}", f"unknown field 'stream_options.{name}'")
    if options.get("continuous_usage_stats"):
        raise InvalidField(
            "stream_options.continuous_usage_stats",
            "'stream_options.continuous_usage_stats' is not supported (usage comes once, "
            "at the end, with include_usage)",
        )
    # include_obfuscation pads chunks against side channels: nothing to pad with here.
    return bool(options.get("include_usage", False))


def parse_openai(body: dict[str, Any], kind: str) -> OpenAIRequest:
    """Parse an OpenAI chat (`kind` ``chat``) or completions (``completion``) body.

    Raises:
        InvalidField: naming the field that is wrong or not supported.
        InvalidArgument: the request as a whole is not valid.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", "'model' is required (GET /v1/models lists the models)")
    _audit(body, kind)
    fields: dict[str, Any] = {"kind": kind, "stop": _stop(body.get("stop"))}
    if kind == "chat":
        fields["messages"] = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidField(
                "prompt", "'prompt' must be a string (one prompt per request, as text)"
            )
        fields["prompt"] = prompt
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    for name in _SAMPLING:
        if body.get(name) is not None:
            fields[name] = body[name]
    fields["logprobs"] = _logprobs(body, kind)
    fields["response_format"] = _response_format(body.get("response_format"))
    try:
        request = GenerationRequest.model_validate(fields)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in errors
        )
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        raise InvalidField(param, f"invalid request: {problems}") from None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidField("stream", "'stream' must be true or false")
    return OpenAIRequest(model, request, bool(stream), _stream_options(body, bool(stream)))
