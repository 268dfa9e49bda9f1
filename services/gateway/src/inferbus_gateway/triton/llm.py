"""Generative models over Triton's tensor protocol, as Triton's vLLM backend speaks it.

A client of Triton's vLLM backend sends, on ModelStreamInfer, a request
with the BYTES input ``text_input`` (the prompt) and optionally ``stream``
(BOOL: one response per generation step), ``sampling_parameters`` (BYTES:
JSON such as ``{"max_tokens": 64, "temperature": 0}``; without it the
request's own parameters are read), ``exclude_input_in_output`` (BOOL) and
``return_finish_reason`` / ``return_num_input_tokens`` /
``return_num_output_tokens`` (BOOL); it gets BYTES ``text_output``. Here the
request becomes a `GenerationRequest` on the generative path (the same one
the OpenAI endpoints use: admission, router, LLM worker, cancel on
disconnect), and the chunks come back as responses: streamed, one per chunk
with the new text, the last with ``triton_final_response: true``; not
streamed, one response with the whole text, the prompt first unless
``exclude_input_in_output``. The input may also carry the model's own input
name from its config (then the output carries its output name). Details:
docs/architecture.md ("Streaming and decoupled models").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_common.generation import GenerationChunk, GenerationRequest
from inferbus_common.modelconfig import ModelConfig

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
_RESERVED = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "triton_enable_empty_final_response",
    }
)
"""Request parameters Triton itself reads; never sampling parameters."""
_SAMPLING = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
    }
)


@dataclass(slots=True)
class LlmCall:
    """A tensor request read as a generation, and how to answer it."""

    request: GenerationRequest
    stream: bool = False
    prepend_prompt: bool = True
    output: str = TEXT_OUTPUT
    extras: set[str] = field(default_factory=set)
    """Which of finish_reason, num_input_tokens, num_output_tokens to return."""
    text: list[str] = field(default_factory=list)
    """Text so far (not streamed: the answer is sent once, at the end)."""
    completion_tokens: int = 0


def _scalar(tensor: Tensor) -> Any:
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidArgument(f"input '{tensor.name}' must hold one element, not {values.size}")
    return values[0]


def _text(tensor: Tensor) -> str:
    value = _scalar(tensor)
    if tensor.datatype != "BYTES":
        raise InvalidArgument(f"input '{tensor.name}' must be BYTES, not {tensor.datatype}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"input '{tensor.name}' is not UTF-8 text") from None


def _flag(tensor: Tensor) -> bool:
    if tensor.datatype != "BOOL":
        raise InvalidArgument(f"input '{tensor.name}' must be BOOL, not {tensor.datatype}")
    return bool(_scalar(tensor))


def read_call(
    config: ModelConfig, inputs: list[Tensor], parameters: Mapping[str, object]
) -> LlmCall:
    """A generative request from Triton vLLM-backend inputs and request parameters.

    Raises:
        InvalidArgument: no prompt, unknown inputs, malformed sampling parameters,
            or ``stream`` with ``exclude_input_in_output`` false (as the backend).
    """
    by_name = {t.name: t for t in inputs}
    own_in = config.inputs[0].name
    prompt_tensor = by_name.pop(TEXT_INPUT, None)
    output = TEXT_OUTPUT
    if prompt_tensor is None and own_in in by_name:
        prompt_tensor = by_name.pop(own_in)
        output = config.outputs[0].name
    if prompt_tensor is None:
        raise InvalidArgument(
            f"model '{config.name}' is generative: send the prompt as BYTES input "
            f"'{TEXT_INPUT}' (Triton's vLLM backend contract)"
        )
    prompt = _text(prompt_tensor)
    flags = {name: _flag(by_name.pop(name)) for name in _FLAGS if name in by_name}
    sampling_tensor = by_name.pop("sampling_parameters", None)
    if by_name:
        raise InvalidArgument(
            f"unknown input(s) {sorted(by_name)} for generative model '{config.name}'; it takes "
            f"{TEXT_INPUT}, stream, sampling_parameters, exclude_input_in_output, "
            "return_finish_reason, return_num_input_tokens, return_num_output_tokens"
        )
    if sampling_tensor is not None:
        try:
            sampling = orjson.loads(_text(sampling_tensor))
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"sampling_parameters is not JSON: {exc}") from None
        if not isinstance(sampling, dict):
            raise InvalidArgument("sampling_parameters must be a JSON object")
    else:
        sampling = {k: v for k, v in parameters.items() if k not in _RESERVED}
    unknown = sorted(set(sampling) - _SAMPLING)
    if unknown:
        raise InvalidArgument(
            f"sampling parameter(s) {unknown} are not supported; supported: {sorted(_SAMPLING)}"
        )
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    try:
        request = GenerationRequest(kind="completion", prompt=prompt, **sampling)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgument(f"sampling parameter {where}: {first['msg']}") from None
    stream = flags.get("stream", False)
    exclude = flags.get("exclude_input_in_output")
    if stream and exclude is False:
        raise InvalidArgument("when streaming, exclude_input_in_output = false is not allowed")
    return LlmCall(
        request,
        stream=stream,
        prepend_prompt=not stream and not exclude,
        output=output,
        extras={
            name.removeprefix("return_")
            for name in (
                "return_finish_reason",
                "return_num_input_tokens",
                "return_num_output_tokens",
            )
            if flags.get(name)
        },
    )


def _bytes_tensor(name: str, text: str) -> Tensor:
    arr = np.empty(1, dtype=object)
    arr[0] = text.encode("utf-8")
    return tensor_from_numpy(name, arr)


def chunk_outputs(call: LlmCall, chunk: GenerationChunk, *, final: bool) -> list[Tensor] | None:
    """The outputs of the response a chunk makes (None: not streamed, nothing to send yet)."""
    call.completion_tokens = chunk.completion_tokens or call.completion_tokens + chunk.tokens
    if not call.stream:
        call.text.append(chunk.text)
        if not final:
            return None
        text = "".join(call.text)
        if call.prepend_prompt:
            text = call.request.prompt + text
    else:
        text = chunk.text
    outputs = [_bytes_tensor(call.output, text)]
    if "finish_reason" in call.extras:
        outputs.append(_bytes_tensor("finish_reason", str(chunk.finish_reason)))
    if "num_input_tokens" in call.extras and final:
        outputs.append(
            tensor_from_numpy("num_input_tokens", np.array(chunk.prompt_tokens, dtype=np.uint32))
        )
    if "num_output_tokens" in call.extras:
        count = chunk.tokens if call.stream else call.completion_tokens
        outputs.append(tensor_from_numpy("num_output_tokens", np.array([count], dtype=np.uint32)))
    return outputs
