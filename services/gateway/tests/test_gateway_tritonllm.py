"""Triton's vLLM backend contract read into generation requests, and chunks into responses."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.errors import InvalidArgument
from inferbus_common.generation import GenerationChunk
from inferbus_common.modelconfig import ModelConfig
from inferbus_gateway.triton.llm import chunk_outputs, read_call

CONFIG = ModelConfig.model_validate(
    {
        "name": "tiny",
        "engine": {"kind": "vllm"},
        "max_batch_size": 0,
        "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
    }
)


def _text(name: str, value: str) -> Tensor:
    arr = np.empty(1, dtype=object)
    arr[0] = value.encode()
    return tensor_from_numpy(name, arr)


def _flag(name: str, value: bool) -> Tensor:
    return tensor_from_numpy(name, np.array([value]))


def _strings(t: Tensor) -> list[str]:
    return [b.decode() for b in t.as_numpy().reshape(-1)]


def test_sampling_parameters_input_and_streaming() -> None:
    call = read_call(
        CONFIG,
        [
            _text("text_input", "Hello"),
            _flag("stream", True),
            _text("sampling_parameters", '{"max_tokens": 5, "temperature": 0, "stop": "x"}'),
        ],
        {},
    )
    assert call.stream and not call.prepend_prompt
    assert call.request.prompt == "Hello" and call.request.max_tokens == 5
    assert call.request.temperature == 0 and call.request.stop == ["x"]
    first = chunk_outputs(call, GenerationChunk(text=" wor", tokens=1), final=False)
    assert first is not None and [t.name for t in first] == ["text_output"]
    assert _strings(first[0]) == [" wor"]
    last = chunk_outputs(
        call, GenerationChunk(text="ld", tokens=1, finish_reason="stop"), final=True
    )
    assert last is not None and _strings(last[0]) == ["ld"]


def test_request_parameters_and_the_whole_text_with_the_prompt() -> None:
    call = read_call(
        CONFIG,
        [_text("text_input", "Hi"), _flag("return_num_output_tokens", True)],
        {"max_tokens": 3, "sequence_id": 0, "priority": 1},
    )
    assert not call.stream and call.prepend_prompt and call.request.max_tokens == 3
    assert chunk_outputs(call, GenerationChunk(text=" a", tokens=1), final=False) is None
    outputs = chunk_outputs(
        call,
        GenerationChunk(text=" b", tokens=1, finish_reason="length", completion_tokens=2),
        final=True,
    )
    assert outputs is not None
    assert _strings(outputs[0]) == ["Hi a b"]
    assert outputs[1].name == "num_output_tokens" and outputs[1].as_numpy().tolist() == [2]


def test_exclude_input_and_the_models_own_tensor_names() -> None:
    call = read_call(CONFIG, [_text("prompt", "Q"), _flag("exclude_input_in_output", True)], {})
    assert call.output == "text" and not call.prepend_prompt
    outputs = chunk_outputs(
        call, GenerationChunk(text="A", tokens=1, finish_reason="stop"), final=True
    )
    assert outputs is not None and outputs[0].name == "text" and _strings(outputs[0]) == ["A"]


@pytest.mark.parametrize(
    ("inputs", "params", "message"),
    [
        ([], {}, "send the prompt"),
        ([_text("text_input", "a"), _text("extra", "b")], {}, "unknown input"),
        ([_text("text_input", "a"), _text("sampling_parameters", "{")], {}, "not JSON"),
        ([_text("text_input", "a")], {"top_k": 3}, "not supported"),
        ([_text("text_input", "a")], {"max_tokens": 0}, "max_tokens"),
        (
            [
                _text("text_input", "a"),
                _flag("stream", True),
                _flag("exclude_input_in_output", False),
            ],
            {},
            "not allowed",
        ),
        ([_text("text_input", "a"), _text("stream", "yes")], {}, "must be BOOL"),
    ],
)
def test_bad_requests_are_refused(inputs: list[Tensor], params: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        read_call(CONFIG, inputs, params)
