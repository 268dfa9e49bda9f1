"""Does each token reach the client as it is made? One stream at a time.

Starts the e2e stack and one LLM worker (``.venvs/vllm``, the tiny offline
Llama, two layers: thousands of engine steps a second, the case where a relay
batches or starves), then sends `--requests` streamed completions one after
another (``ignore_eos``, `--max-tokens` tokens) and records, per stream, what
the client saw: time to first token, SSE events that carried text, socket reads
(``aiter_raw`` pieces: what arrived together), the longest gap between two
events; next to it the worker's and the gateway's own TTFT (their /metrics),
so the time between the gateway and the worker shows as their difference.
A stream whose tokens come as they are made has about one event and one read
per token; a relay that holds chunks back shows fewer reads than tokens and
long gaps.

    uv run python bench/llm_chunks.py --requests 10 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from inferbus_testing.llm import TINY_LLM, build_tiny_llm, start_llm_worker, wait_llm_ready
from inferbus_testing.stack import LocalStack

BODY = {
    "model": TINY_LLM,
    "prompt": "the quick brown fox jumps over the lazy dog " * 6,
    "ignore_eos": True,
    "stream": True,
    "temperature": 0,
}


async def one_stream(http: httpx.AsyncClient, url: str, max_tokens: int) -> dict[str, float]:
    """One streamed completion; what the client saw of it."""
    t0 = time.monotonic()
    first = last = 0.0
    events = reads = 0
    gap = 0.0
    buffer = b""
    async with http.stream("POST", url, json={**BODY, "max_tokens": max_tokens}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for piece in resp.aiter_raw():
            reads += 1
            now = time.monotonic()
            buffer += piece
            *lines, buffer = buffer.split(b"\n\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj["choices"] and obj["choices"][0]["text"]:
                    if first:
                        gap = max(gap, now - last)
                    first = first or now
                    last = now
                    events += 1
    return {
        "ttft_ms": (first - t0) * 1000,
        "total_ms": (last - t0) * 1000,
        "events": events,
        "reads": reads,
        "max_gap_ms": gap * 1000,
    }


def _sum_count(metrics: dict[str, float], name: str) -> tuple[float, float]:
    total = sum(v for k, v in metrics.items() if k.startswith(f"{name}_sum{{"))
    count = sum(v for k, v in metrics.items() if k.startswith(f"{name}_count{{"))
    return total, count


async def run(stack: LocalStack, worker, requests: int, max_tokens: int) -> list[dict]:  # type: ignore[no-untyped-def]
    url = f"http://{stack.http_url}/v1/completions"
    async with httpx.AsyncClient(timeout=120) as http:
        await one_stream(http, url, 4)  # warm-up (first-request costs in every service)
        runs = []
        for _ in range(requests):
            w0 = _sum_count(stack.metrics(worker), "inferbus_llm_time_to_first_token_seconds")
            g0 = _sum_count(
                stack.metrics(stack.gateway), "inferbus_gateway_gen_time_to_first_token_seconds"
            )
            run = await one_stream(http, url, max_tokens)
            w1 = _sum_count(stack.metrics(worker), "inferbus_llm_time_to_first_token_seconds")
            g1 = _sum_count(
                stack.metrics(stack.gateway), "inferbus_gateway_gen_time_to_first_token_seconds"
            )
            run["worker_ttft_ms"] = (w1[0] - w0[0]) * 1000
            run["gateway_ttft_ms"] = (g1[0] - g0[0]) * 1000
            runs.append(run)
    return runs


def loop_numbers(metrics: dict[str, float]) -> dict[str, float]:
    """The LLM worker's loop lag and gc pauses so far, from its /metrics."""
    lag = "inferbus_llm_event_loop_lag_seconds"
    count = metrics.get(f"{lag}_count{{}}", 0.0)
    out = {
        "lag_samples": count,
        "lag_sum_ms": metrics.get(f"{lag}_sum{{}}", 0.0) * 1000,
        "lag_over_20ms": count - metrics.get(f"{lag}_bucket{{le=0.02}}", 0.0),
        "lag_over_50ms": count - metrics.get(f"{lag}_bucket{{le=0.05}}", 0.0),
    }
    for gen in ("0", "1", "2"):
        key = f"inferbus_llm_gc_pause_seconds_{{}}{{{{generation={gen}}}}}"
        out[f"gc{gen}_count"] = metrics.get(key.format("count"), 0.0)
        out[f"gc{gen}_ms"] = metrics.get(key.format("sum"), 0.0) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2, help="the tiny model's depth")
    ap.add_argument(
        "--nice",
        type=int,
        default=10,
        help="niceness added to the LLM worker and its engine (the tests use 10)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llm-chunks-") as tmp:
        base = Path(tmp)
        model_dir = build_tiny_llm(
            base / TINY_LLM, max_num_seqs=2, max_waiting=2, max_len=1024, layers=args.layers
        )
        with LocalStack(base, workers=0, with_redis=True) as stack:
            stack.push(model_dir, TINY_LLM)
            worker = start_llm_worker(stack, base, nice=args.nice)
            wait_llm_ready(stack, worker, TINY_LLM)
            before = loop_numbers(stack.metrics(worker))
            runs = asyncio.run(run(stack, worker, args.requests, args.max_tokens))
            after = loop_numbers(stack.metrics(worker))
    keys = ["ttft_ms", "gateway_ttft_ms", "worker_ttft_ms", "events", "reads", "max_gap_ms"]
    print("| # | " + " | ".join(keys) + " | total_ms |")
    print("|---" * (len(keys) + 2) + "|")
    for i, r in enumerate(runs):
        print(f"| {i} | " + " | ".join(f"{r[k]:.1f}" for k in [*keys, "total_ms"]) + " |")
    print(
        "| mean | "
        + " | ".join(f"{statistics.mean(r[k] for r in runs):.1f}" for k in [*keys, "total_ms"])
        + " |"
    )
    delta = {k: round(after[k] - before[k], 1) for k in after}
    delta["lag_mean_ms"] = round(delta["lag_sum_ms"] / max(1.0, delta["lag_samples"]), 2)
    print("worker loop while streaming:", delta)
    json.dump(runs, sys.stderr)


if __name__ == "__main__":
    main()
