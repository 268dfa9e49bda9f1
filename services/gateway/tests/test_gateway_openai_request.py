"""The OpenAI request audit (`inferbus_gateway.rest.openai_request`): every field is
served, inert at its value, or refused with a 400 that names it."""

from __future__ import annotations

from typing import Any

import pytest

from inferbus_common.generation import GenerationChunk, GenerationRequest, TokenLogprob
from inferbus_gateway.rest.openai import error_body
from inferbus_gateway.rest.openai_request import InvalidField, parse_openai

USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def _refused(body: dict[str, Any], kind: str = "chat") -> InvalidField:
    with pytest.raises(InvalidField) as info:
        parse_openai(body, kind)
    return info.value


def test_content_parts_become_text_joined_by_newlines() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    req = parse_openai(_chat(messages=[{"role": "user", "content": parts}]), "chat").request
    assert req.messages[0].content == "one\ntwo"
    # Survives the bus as a plain string.
    assert GenerationRequest.decode(req.encode()).messages[0].content == "one\ntwo"


def test_a_non_text_part_is_refused_naming_its_type() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
    exc = _refused(
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, image]}])
    )
    assert "image_url" in str(exc)
    assert exc.param == "messages.0.content"
    status, body, _ = error_body(exc)
    assert status == 400
    assert body["error"]["param"] == "messages.0.content"


def test_message_fields_an_sdk_echoes_back_empty_are_accepted() -> None:
    echoed = {"role": "assistant", "content": None, "refusal": None, "tool_calls": None}
    req = parse_openai(_chat(messages=[*USER, echoed]), "chat").request
    assert req.messages[1].content == ""
    exc = _refused(_chat(messages=[{**echoed, "tool_calls": [{"id": "1"}]}]))
    assert exc.param == "messages.0.tool_calls"


def test_logprobs_per_endpoint() -> None:
    assert parse_openai(_chat(logprobs=True, top_logprobs=3), "chat").request.logprobs == 3
    assert parse_openai(_chat(logprobs=True), "chat").request.logprobs == 0
    assert parse_openai(_chat(logprobs=False), "chat").request.logprobs is None
    assert _refused(_chat(top_logprobs=2)).param == "top_logprobs"
    assert _refused(_chat(logprobs=2)).param == "logprobs"
    assert _refused(_chat(logprobs=True, top_logprobs=21)).param == "top_logprobs"
    completion = {"model": "m", "prompt": "p"}
    assert parse_openai({**completion, "logprobs": 2}, "completion").request.logprobs == 2
    assert _refused({**completion, "logprobs": True}, "completion").param == "logprobs"


def test_response_format() -> None:
    def fmt(value: Any) -> Any:
        return parse_openai(_chat(response_format=value), "chat").request.response_format

    assert fmt({"type": "text"}) is None
    assert fmt({"type": "json_object"}).type == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = fmt({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert (got.type, got.json_schema) == ("json_schema", schema)
    assert _refused(_chat(response_format={"type": "json_schema"})).param == (
        "response_format.json_schema"
    )
    assert _refused(_chat(response_format={"type": "grammar"})).param == "response_format.type"


def test_n_stop_seed_and_vllm_extensions_are_carried() -> None:
    req = parse_openai(
        _chat(n=2, stop=["a", "b"], seed=7, top_k=5, min_p=0.1, repetition_penalty=1.0),
        "chat",
    ).request
    assert (req.n, req.stop, req.seed, req.top_k, req.min_p) == (2, ["a", "b"], 7, 5, 0.1)
    assert _refused(_chat(n=0)).param == "n"
    assert _refused(_chat(stop=["a", 1])).param == "stop"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("logit_bias", {"5": 10}),
        ("store", True),
        ("echo", True),
        ("best_of", 3),
        ("min_tokens", 4),
        ("audio", {"voice": "x"}),
        ("frobnicate", 1),
    ],
)
def test_unsupported_fields_are_refused_by_name(field: str, value: Any) -> None:
    exc = _refused(_chat(**{field: value}))
    assert exc.param == field
    assert field in str(exc)


def test_inert_values_pass() -> None:
    parsed = parse_openai(
        _chat(user="u", tools=[], logit_bias={}, store=False, echo=False, best_of=1, n=1),
        "chat",
    )
    assert parsed.request.n == 1


def test_stream_options() -> None:
    assert parse_openai(_chat(stream=True, stream_options={"include_usage": True}), "chat")
    assert _refused(_chat(stream_options={"include_usage": True})).param == "stream_options"
    exc = _refused(_chat(stream=True, stream_options={"continuous_usage_stats": True}))
    assert exc.param == "stream_options.continuous_usage_stats"
    assert _refused(_chat(stream=True, stream_options={"x": 1})).param == "stream_options.x"


def test_a_chunk_with_logprobs_round_trips() -> None:
    chunk = GenerationChunk(
        text="ab",
        tokens=2,
        index=1,
        logprobs=[
            TokenLogprob("a", -0.5, [("a", -0.5), ("b", -1.0)]),
            TokenLogprob("b", -9999.0, []),
        ],
    )
    assert GenerationChunk.decode(chunk.encode()) == chunk
