"""Generative path end to end: the real vLLM engine (CPU wheel) behind the gateway.

Stack: nats-server, redis-server, registry, router, batcher, gateway (as in the
other e2e tests, no tensor workers) and one LLM worker run with the interpreter
of ``.venvs/vllm`` (``scripts/bootstrap-llm.sh``), serving the tiny offline
Llama built by ``examples/tiny-llm/build.py`` (random weights, a locally trained
tokenizer). The ``openai`` package talks to the gateway's ``/v1`` endpoints.

Skipped, with the reason, when ``.venvs/vllm`` is missing. The engine starts
once per module (~20 s on CPU), and once more in the last test, which kills it.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import redis
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from inferbus_testing.llm import (
    TINY_LLM,
    VLLM_PYTHON,
    build_tiny_llm,
    start_llm_worker,
    wait_llm_ready,
)
from inferbus_testing.processes import ServiceProcess
from inferbus_testing.stack import LocalStack

MODEL = TINY_LLM
MAX_NUM_SEQS = 2
MAX_WAITING = 1
LAYERS = 16
"""The tiny model's depth here. With two layers the engine generated 400-2,200
tokens in the second before a non-streamed client's read timeout (with sixteen,
about 210), and the LLM worker's loop fell behind it at times: chunks reached
the gateway in bursts seconds apart, and a generation could finish before a
client's disconnect got through."""
BOUND = MAX_NUM_SEQS + MAX_WAITING

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason=f"no vLLM environment at {VLLM_PYTHON}: run scripts/bootstrap-llm.sh",
    ),
]


class LlmStack(LocalStack):
    """The stack plus one LLM worker and the tiny model."""

    llm: ServiceProcess
    model_dir: Path


def _wait(predicate, timeout: float, what: str, step: float = 0.05, show=None) -> float:  # type: ignore[no-untyped-def]
    """Poll until `predicate()` is true; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(step)
    raise TimeoutError(f"{what} not true after {timeout}s" + (f": {show()}" if show else ""))


@pytest.fixture(scope="module")
def llm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmStack]:
    base = tmp_path_factory.mktemp("llm-stack")
    # Room for a generation long enough to be interrupted mid-way even when the
    # engine outpaces the client (see the disconnect test).
    model_dir = build_tiny_llm(
        base / MODEL,
        max_num_seqs=MAX_NUM_SEQS,
        max_waiting=MAX_WAITING,
        max_len=16384,
        layers=LAYERS,
    )
    st = LlmStack(base, workers=0, with_redis=True)
    st.model_dir = model_dir
    with st:
        st.push(model_dir, MODEL)
        st.llm = start_llm_worker(st, base)
        wait_llm_ready(st, st.llm, MODEL)
        yield st


@pytest.fixture
def client(llm_stack: LlmStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"http://{llm_stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


def _prompt_tokens(stack: LlmStack, text: str) -> int:
    """Tokens of the chat-templated prompt, counted with the model's own tokenizer."""
    tok = Tokenizer.from_file(str(stack.model_dir / "hf" / "tokenizer.json"))
    return len(tok.encode(f"<|user|>{text}\n<|assistant|>", add_special_tokens=False).ids)


def _llm_metric(stack: LlmStack, name: str, **labels: str) -> float:
    want = {"model": MODEL, "version": "1", **labels}
    key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(want.items())) + "}"
    return stack.metrics(stack.llm).get(key, 0.0)


def _llm_state(stack: LlmStack) -> dict[str, float]:
    """The worker's request gauges and counters, for failure messages."""
    return {
        k: v
        for k, v in stack.metrics(stack.llm).items()
        if k.startswith(
            (
                "inferbus_llm_in_flight",
                "inferbus_llm_engine_unfinished",
                "inferbus_llm_aborted_total",
                "inferbus_llm_requests_total",
                "inferbus_llm_running",
                "inferbus_llm_waiting",
            )
        )
    }


def test_models_lists_the_generative_model(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids


def test_chat_completion_streamed_and_not_with_usage(
    llm_stack: LlmStack, client: openai.OpenAI
) -> None:
    text = "hello world"
    prompt_tokens = _prompt_tokens(llm_stack, text)
    messages = [{"role": "user", "content": text}]
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == prompt_tokens + 12

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    pieces, finish, usage, content_chunks = [], None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                content_chunks += 1
            finish = choice.finish_reason or finish
    assert content_chunks > 1, "tokens came as one block, not streamed"
    assert finish == "length"
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 12)
    assert usage.total_tokens == prompt_tokens + 12
    # Greedy decoding: the streamed chunks, in order, make up the same text.
    assert "".join(pieces) == whole.choices[0].message.content


def test_streaming_is_measured_by_worker_and_gateway(
    llm_stack: LlmStack, client: openai.OpenAI
) -> None:
    """TTFT, inter-token latency, tokens/s and KV usage are exported (values printed)."""
    worker_ttft = _llm_metric(llm_stack, "inferbus_llm_time_to_first_token_seconds_count")
    ttft_sum = _llm_metric(llm_stack, "inferbus_llm_time_to_first_token_seconds_sum")
    tps_sum = _llm_metric(llm_stack, "inferbus_llm_request_tokens_per_second_sum")
    t0 = time.monotonic()
    first_at = 0.0
    chunks = 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "measure me"}],
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            first_at = first_at or time.monotonic()
    end = time.monotonic()
    ttft = _llm_metric(llm_stack, "inferbus_llm_time_to_first_token_seconds_sum") - ttft_sum
    tps = _llm_metric(llm_stack, "inferbus_llm_request_tokens_per_second_sum") - tps_sum
    print(
        f"200 tokens in {chunks} chunks; worker: TTFT {ttft * 1000:.0f} ms, {tps:.0f} tokens/s; "
        f"client: TTFT {(first_at - t0) * 1000:.0f} ms, whole stream {(end - t0) * 1000:.0f} ms"
    )
    assert _llm_metric(llm_stack, "inferbus_llm_time_to_first_token_seconds_count") == (
        worker_ttft + 1
    )
    worker = llm_stack.metrics(llm_stack.llm)
    gateway = llm_stack.metrics(llm_stack.gateway)
    labels = "{model=tiny-llm,version=1}"
    for name in (
        "inferbus_llm_inter_token_seconds_count",
        "inferbus_llm_request_tokens_per_second_count",
        "inferbus_llm_queue_seconds_count",
        "inferbus_llm_kv_cache_usage_ratio",
        "inferbus_llm_running_sequences",
        "inferbus_llm_waiting_sequences",
    ):
        assert name + labels in worker, name
    assert gateway["inferbus_gateway_gen_time_to_first_token_seconds_count{model=tiny-llm}"] >= 1
    assert gateway["inferbus_gateway_gen_tokens_total{kind=completion,model=tiny-llm}"] >= 200
    assert any(k.startswith("vllm:") for k in worker), "vLLM's own metrics are exported too"


def test_completions_endpoint(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens > 0
    assert isinstance(out.choices[0].text, str)


def _triton_generate(stack: LlmStack, prompt: str, *, stream: bool) -> list[object]:
    """One request with Triton's vLLM backend contract over ModelStreamInfer; the
    responses until the one marked final."""
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("stream", [1], "BOOL"),
        grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
    ]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream]))
    sampling = json.dumps({"max_tokens": 8, "temperature": 0, "ignore_eos": True})
    inputs[2].set_data_from_numpy(np.array([sampling.encode()], dtype=np.object_))
    done: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(stack.grpc_url) as g:
        g.start_stream(callback=lambda result, error: done.put(error or result))
        g.async_stream_infer(MODEL, inputs, request_id=f"gen-{stream}")
        responses = []
        while True:
            item = done.get(timeout=60)
            assert not isinstance(item, InferenceServerException), item
            responses.append(item)
            if item.get_response().parameters["triton_final_response"].bool_param:
                return responses


def test_triton_vllm_contract_over_model_stream_infer(
    llm_stack: LlmStack, client: openai.OpenAI
) -> None:
    prompt = "hello world"
    expected = (
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    streamed = _triton_generate(llm_stack, prompt, stream=True)
    assert len(streamed) > 1  # one response per generation step
    deltas = [r.as_numpy("text_output")[0].decode() for r in streamed]
    assert "".join(deltas) == expected
    assert all(r.get_response().id == "gen-True" for r in streamed)
    (whole,) = _triton_generate(llm_stack, prompt, stream=False)
    # Not streamed: the prompt comes first, as Triton's vLLM backend answers.
    assert whole.as_numpy("text_output")[0].decode() == prompt + expected


def test_errors_have_openai_shape_and_status(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert nf.value.status_code == 404
    assert "no-such-model" in nf.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logit_bias={"5": 10}
        )
    assert refused.value.body["param"] == "logit_bias"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )
    assert "context" in too_long.value.message


def test_client_disconnect_aborts_the_engine_request(llm_stack: LlmStack) -> None:
    """A client that leaves after three chunks: the engine stops generating for it.

    It leaves at once rather than first checking the worker and engine hold the
    request: under load those checks took seconds, enough for the engine to
    finish the whole generation first. Mid-stream is proved after the fact:
    the request was aborted (counted by the worker as cancelled) having
    generated far fewer than the 16,000 tokens asked for, and generation stops.
    """
    max_tokens = 16000
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    aborted_before = _llm_metric(llm_stack, "inferbus_llm_aborted_total", why="cancelled")
    generated_before = _llm_metric(llm_stack, "inferbus_llm_generated_tokens_total")
    url = f"http://{llm_stack.http_url}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # httpx closes the connection when a stream is abandoned
    t_closed = time.monotonic()

    def engine_idle() -> bool:
        return (
            _llm_metric(llm_stack, "inferbus_llm_aborted_total", why="cancelled")
            == aborted_before + 1
            and _llm_metric(llm_stack, "inferbus_llm_engine_unfinished_requests") == 0
            and _llm_metric(llm_stack, "inferbus_llm_in_flight") == 0
        )

    _wait(engine_idle, 10, "engine request aborted", show=lambda: _llm_state(llm_stack))
    took = time.monotonic() - t_closed
    generated = _llm_metric(llm_stack, "inferbus_llm_generated_tokens_total")
    print(
        f"disconnect → engine aborted in {took * 1000:.0f} ms, "
        f"after {generated - generated_before:.0f} of {max_tokens} tokens"
    )
    assert generated - generated_before < max_tokens
    time.sleep(0.5)
    assert _llm_metric(llm_stack, "inferbus_llm_generated_tokens_total") == generated


def test_non_streamed_request_is_aborted_when_its_client_leaves(llm_stack: LlmStack) -> None:
    """Nothing is sent before the end of a non-streamed answer; the gateway's
    disconnect watcher cancels it all the same, whether or not its first token
    came yet (under load the first token came 16 s after the request once)."""
    aborted_before = _llm_metric(llm_stack, "inferbus_llm_aborted_total", why="cancelled")
    generated_before = _llm_metric(llm_stack, "inferbus_llm_generated_tokens_total")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 16000,
        "ignore_eos": True,
    }
    url = f"http://{llm_stack.http_url}/v1/chat/completions"
    with httpx.Client(timeout=httpx.Timeout(30, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection
            http.post(url, json=body)
    took = _wait(
        lambda: (
            _llm_metric(llm_stack, "inferbus_llm_aborted_total", why="cancelled")
            == aborted_before + 1
            and _llm_metric(llm_stack, "inferbus_llm_in_flight") == 0
        ),
        10,
        "engine request aborted",
        show=lambda: _llm_state(llm_stack),
    )
    generated = _llm_metric(llm_stack, "inferbus_llm_generated_tokens_total")
    print(
        f"disconnect → engine aborted in {took * 1000:.0f} ms, "
        f"after {generated - generated_before:.0f} of 16000 tokens"
    )
    assert generated - generated_before < 16000


async def test_overload_excess_streams_get_429_promptly(llm_stack: LlmStack) -> None:
    url = f"http://{llm_stack.http_url}/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to a thousand"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    offered = BOUND + 3
    statuses: list[int] = []
    refused_after: list[float] = []
    release = asyncio.Event()
    answered = asyncio.Event()

    async def one(http: httpx.AsyncClient) -> None:
        t0 = time.monotonic()
        async with http.stream("POST", url, json=body) as resp:
            statuses.append(resp.status_code)
            answered.set()
            if resp.status_code == 429:
                refused_after.append(time.monotonic() - t0)
                err = json.loads(await resp.aread())["error"]
                assert err["type"] == "rate_limit_error"
                assert err["code"] == "llm-full"
                assert "Retry-After" in resp.headers
                return
            await release.wait()  # hold the stream open, then disconnect

    async with httpx.AsyncClient(timeout=30) as http:
        tasks = [asyncio.create_task(one(http)) for _ in range(offered)]
        # Admitted streams are held open until every refusal came back (the one
        # waiting in the engine behind the running ones answers after the release).
        async with asyncio.timeout(30):
            while statuses.count(429) < offered - BOUND or statuses.count(200) < MAX_NUM_SEQS:
                answered.clear()
                await answered.wait()
        release.set()
        await asyncio.gather(*tasks)
    assert sorted(statuses) == [200] * BOUND + [429] * (offered - BOUND), statuses
    print(f"429 answered in {max(refused_after) * 1000:.0f} ms (max of {len(refused_after)})")
    # Promptly: refusals do not wait for a running generation (~1500 tokens) to end.
    assert max(refused_after) < 5.0
    _wait(lambda: _llm_metric(llm_stack, "inferbus_llm_in_flight") == 0, 10, "streams released")


def test_tokens_per_minute_limit_refuses_a_tenant_in_debt(
    llm_stack: LlmStack, client: openai.OpenAI
) -> None:
    assert llm_stack.redis is not None
    r = redis.Redis.from_url(llm_stack.redis.url)
    # Auth is off: every caller is tenant "anonymous". 60 tokens/min = 1/s.
    r.hset("ib:tpm", "anonymous", json.dumps({"tpm": 60, "burst": 20}))
    try:
        # The gateway reads which tenants have a limit every 0.5 s; until it has
        # this one it does not charge the tenant.
        _wait(
            lambda: llm_stack.metrics(llm_stack.gateway).get("inferbus_gateway_tpm_limits{}") == 1,
            10,
            "the gateway loaded the TPM limit",
        )
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, extra_body={"ignore_eos": True}
        )
        assert first.usage is not None and first.usage.completion_tokens == 30
        # prompt + 30 tokens settled: the bucket is below the next estimate now.
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["X-Inferbus-Reason"] == "tenant-tpm"
        assert int(refused.value.response.headers["Retry-After"]) >= 1
    finally:
        r.hdel("ib:tpm", "anonymous")
        r.delete("{ib:tpm}:anonymous")
        r.close()


def _engine_core_pids(worker_pid: int) -> list[int]:
    """vLLM's engine-core processes among the worker's children (from /proc).

    vLLM names them ``VLLM::EngineCore`` (setproctitle, a vLLM dependency).
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and cmdline.startswith(b"VLLM::EngineCore"):
            pids.append(int(entry.name))
    return pids


def test_dead_engine_is_restarted_in_process(llm_stack: LlmStack, client: openai.OpenAI) -> None:
    """SIGKILL of vLLM's engine-core process (as the OOM killer would do it).

    The stream it was generating ends with one error event; a request right
    after is refused at once with 503; the worker is not ready meanwhile; it
    restarts the engine in the same process and serves again. Last in the
    module: it leaves the stack serving, with a new engine.
    """
    # Once every earlier stream is over the engine holds nothing (an old note said
    # the unfinished gauge stayed at 1 after streams finished).
    _wait(
        lambda: (
            _llm_metric(llm_stack, "inferbus_llm_engine_unfinished_requests") == 0
            and _llm_metric(llm_stack, "inferbus_llm_in_flight") == 0
        ),
        10,
        "engine idle",
        show=lambda: _llm_state(llm_stack),
    )
    worker_pid = llm_stack.llm.pid
    assert worker_pid is not None
    [core] = _engine_core_pids(worker_pid)
    restarts = _llm_metric(llm_stack, "inferbus_llm_engine_restarts_total", result="ok")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 16000,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"http://{llm_stack.http_url}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: {")
                if seen == 3:
                    break
            os.kill(core, signal.SIGKILL)
            t_killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
    stream_ended = time.monotonic() - t_killed
    errors = [
        json.loads(line[6:])["error"]
        for line in rest
        if line.startswith("data: {") and "error" in json.loads(line[6:])
    ]
    assert len(errors) == 1, rest[-3:]
    assert "the vLLM engine died; retry" in errors[0]["message"]
    assert rest[-1] == "data: [DONE]"

    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    refused_in = time.monotonic() - t0
    assert refused.value.status_code == 503, refused.value.message
    # From the worker ("…: the vLLM engine died; retry …") or, once its heartbeat
    # says so, from the gateway ("… is not ready (restarting: the vLLM engine died)").
    assert "the vLLM engine died" in refused.value.message
    assert refused_in < 5.0
    ready = httpx.get(llm_stack.llm.readyz_url(), timeout=5)
    assert ready.status_code == 503
    assert "the vLLM engine died" in ready.json()["reason"]

    def serves() -> bool:
        try:
            out = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc.message  # never a 500 meanwhile
            return False
        return out.usage is not None and out.usage.completion_tokens == 4

    recovered_in = _wait(serves, 90, "chat completions served again", step=0.5)
    print(
        f"engine killed → stream ended in {stream_ended * 1000:.0f} ms, next request "
        f"refused in {refused_in * 1000:.0f} ms, serving again after {recovered_in:.1f} s"
    )
    assert llm_stack.llm.running and llm_stack.llm.pid == worker_pid  # the same process
    assert _llm_metric(llm_stack, "inferbus_llm_engine_restarts_total", result="ok") == (
        restarts + 1
    )
    [new_core] = _engine_core_pids(worker_pid)
    assert new_core != core
    assert httpx.get(llm_stack.llm.readyz_url(), timeout=5).status_code == 200
    log = llm_stack.llm.log_path.read_text()
    assert "the vLLM engine died" in log and "vLLM engine restarted" in log
