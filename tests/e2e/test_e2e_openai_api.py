"""The OpenAI API as vLLM serves it, through the unmodified ``openai`` client.

One stack for the module (nats-server, redis-server, registry, router, batcher,
gateway and one LLM worker running vLLM's CPU engine from ``.venvs/vllm``) serving
the tiny offline Llama (random weights, a locally trained tokenizer), so every
option is checked against what vLLM itself computes: content parts, ``logprobs``
/ ``top_logprobs``, ``response_format`` (``json_object``, ``json_schema``),
``n``, ``stop``, ``seed``, ``stream_options.include_usage``, and a refused
field's 400.

The model's words are random, which the checks use: greedy decoding makes every
answer reproducible, an unconstrained answer is not JSON, and two samplings at
temperature 1 with different seeds do not agree. Completions are a few tokens
long (a loaded 2-core machine). Skipped, with the reason, without ``.venvs/vllm``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from inferbus_testing.llm import (
    TINY_LLM,
    VLLM_PYTHON,
    build_tiny_llm,
    start_llm_worker,
    wait_llm_ready,
)
from inferbus_testing.stack import LocalStack

MODEL = TINY_LLM
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
"""Reproducible answers of exactly ``max_tokens`` tokens."""
QUESTION = "hello world"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason=f"no vLLM environment at {VLLM_PYTHON}: run scripts/bootstrap-llm.sh",
    ),
]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    base = tmp_path_factory.mktemp("openai-api")
    # Two sequences at once: n=2 runs both completions together. Short answers
    # only, so the two-layer model (fast steps) does not hog the machine for long.
    model_dir = build_tiny_llm(base / MODEL, max_num_seqs=2, max_waiting=2, max_len=512, layers=2)
    with LocalStack(base, workers=0, with_redis=True) as stack:
        stack.push(model_dir, MODEL)
        worker = start_llm_worker(stack, base)
        wait_llm_ready(stack, worker, MODEL)
        with openai.OpenAI(
            base_url=f"http://{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60
        ) as c:
            yield c


def _chat(client: openai.OpenAI, content: Any = QUESTION, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def test_content_parts_are_the_same_prompt_as_a_string(client: openai.OpenAI) -> None:
    plain = _chat(client, "one\ntwo", max_tokens=6, **GREEDY)
    parts = _chat(
        client,
        [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        max_tokens=6,
        **GREEDY,
    )
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content
    other = _chat(client, "something else entirely", max_tokens=6, **GREEDY)
    assert other.usage.prompt_tokens != plain.usage.prompt_tokens  # the prompt counts


def test_a_non_text_part_is_a_400_naming_its_type(client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [{"type": "text", "text": "look"}, image], max_tokens=4)
    assert info.value.status_code == 400
    assert "image_url" in info.value.message
    assert info.value.body["param"] == "messages.0.content"  # type: ignore[index]


def test_chat_logprobs_with_top_alternatives(client: openai.OpenAI) -> None:
    answer = _chat(client, max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 4
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 3
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
        # Greedy: the token taken is the likeliest one.
        assert (token.token, token.logprob) == (
            token.top_logprobs[0].token,
            token.top_logprobs[0].logprob,
        )
        assert token.bytes == list(token.token.encode())
    plain = _chat(client, max_tokens=4, **GREEDY)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == answer.choices[0].message.content


def test_streamed_chat_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    stream = _chat(client, max_tokens=5, logprobs=True, stream=True, **GREEDY)
    tokens = 0
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += len(choice.logprobs.content)
                assert all(t.top_logprobs == [] for t in choice.logprobs.content)
    assert tokens == 5


def test_completion_logprobs_in_the_completions_shape(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=4, logprobs=2, **GREEDY
    )
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2
        assert top[token] == logprob == max(top.values())  # greedy


def test_json_object_answers_a_json_object(client: openai.OpenAI) -> None:
    free = _chat(client, max_tokens=24, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # the random model writes no JSON
    # Sampled (seeded, so reproducible): greedy decoding of the random weights did
    # not close the object within max_tokens (finish_reason "length").
    answer = _chat(
        client, max_tokens=64, temperature=1, seed=5, response_format={"type": "json_object"}
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_json_schema_answers_valid_json(client: openai.OpenAI) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = _chat(
        client,
        max_tokens=24,
        temperature=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": schema, "strict": True},
        },
    )
    assert answer.choices[0].finish_reason == "stop"
    assert json.loads(answer.choices[0].message.content) in ("yes", "no")


def test_n_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    answer = _chat(
        client, max_tokens=5, n=2, temperature=1, seed=11, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in answer.choices)
    assert answer.usage.completion_tokens == 10
    assert answer.choices[0].message.content != answer.choices[1].message.content

    stream = _chat(
        client,
        max_tokens=5,
        n=2,
        temperature=1,
        seed=11,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    roles = []
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1]  # each choice's first chunk says who speaks
    assert finished == {0: "length", 1: "length"}
    # The same seed: the same two completions as the whole answer.
    assert texts == {c.index: c.message.content for c in answer.choices}


def test_stop_ends_the_answer_before_the_stop_string(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=16, **GREEDY
    ).choices[0]
    text = full.text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    cut = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=16, stop=[stop], **GREEDY
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            _chat(client, max_tokens=8, temperature=1, seed=seed, extra_body={"ignore_eos": True})
            .choices[0]
            .message.content
        )

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_include_usage_ends_the_stream_with_usage(client: openai.OpenAI) -> None:
    def usage_chunks(**kwargs: Any) -> tuple[list[Any], list[Any]]:
        chunks = list(_chat(client, max_tokens=3, stream=True, **GREEDY, **kwargs))
        return [c for c in chunks if c.usage is not None], chunks

    with_usage, chunks = usage_chunks(stream_options={"include_usage": True})
    assert len(with_usage) == 1 and chunks[-1] is with_usage[0]
    assert with_usage[0].choices == []
    assert with_usage[0].usage.completion_tokens == 3
    assert with_usage[0].usage.total_tokens == with_usage[0].usage.prompt_tokens + 3
    without, _ = usage_chunks()
    assert without == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("logit_bias", {"5": 10}), ("tools", [{"type": "function", "function": {"name": "f"}}])],
)
def test_an_unsupported_option_is_a_400_naming_it(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, max_tokens=4, **{field: value})
    assert info.value.status_code == 400
    assert info.value.body["param"] == field  # type: ignore[index]
    assert field in info.value.message
    # ... and the service keeps serving.
    assert _chat(client, max_tokens=2, **GREEDY).usage.completion_tokens == 2
