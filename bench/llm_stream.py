"""Streaming throughput of the generative path: the real vLLM engine (CPU wheel)
behind the gateway, measured by an SSE client.

Starts the e2e stack (nats-server, registry, router, batcher, gateway; no tensor
workers) and one LLM worker from ``.venvs/vllm`` serving the tiny offline Llama
(``examples/tiny-llm/build.py``), then, for each concurrency, opens that many
``/v1/chat/completions`` streams at once (``ignore_eos``, fixed ``max_tokens``)
and records what the client saw: time to first token, tokens and SSE events
received, aggregate tokens/s; next to it the worker's own count of generated
tokens and chunks published over the same window, so a relay that falls behind
the engine shows as a ratio. One JSON line per concurrency goes to
``bench/results/llm-stream-<time>.jsonl``; a Markdown table is printed.

    uv run python bench/llm_stream.py --concurrency 1 4 8 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:  # the engine-only child runs in .venvs/vllm, without inferbus_testing
    from inferbus_testing.processes import ServiceProcess
    from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"
MODEL = "tiny-llm"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_window import read_stat  # noqa: E402
from record import machine_info  # noqa: E402


async def one_stream(http: httpx.AsyncClient, url: str, max_tokens: int) -> dict[str, float]:
    """One streamed chat completion; what the client saw of it."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to a thousand"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    first = last = 0.0
    events = 0
    tokens = 0
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
                continue
            if obj["choices"] and obj["choices"][0]["delta"].get("content"):
                now = time.monotonic()
                first = first or now
                last = now
                events += 1
    return {"ttft_s": first - t0, "last_s": last - t0, "events": events, "tokens": tokens}


def _ticks(pid: int) -> int:
    """utime + stime of a process (clock ticks), 0 if it is gone."""
    stat = read_stat(pid)
    return stat.cpu_ticks if stat is not None else 0


def _family(pid: int) -> list[int]:
    """A process and its descendants (vLLM's engine core is a child of the worker)."""
    out = [pid]
    for tid in Path(f"/proc/{pid}/task").iterdir() if Path(f"/proc/{pid}").exists() else []:
        with contextlib.suppress(OSError):
            for child in (tid / "children").read_text().split():
                out += _family(int(child))
    return out


def cpu_seconds(stack: LocalStack, worker: ServiceProcess) -> dict[str, float]:
    """CPU seconds so far of the gateway, the LLM worker and its engine core."""
    hz = os.sysconf("SC_CLK_TCK")
    gateway = stack.gateway.pid or 0
    wpid = worker.pid or 0
    family = _family(wpid)
    return {
        "gateway": _ticks(gateway) / hz,
        "llm_worker": _ticks(wpid) / hz,
        "engine_core": sum(_ticks(p) for p in family[1:]) / hz,
    }


def worker_counts(stack: LocalStack, worker: ServiceProcess) -> tuple[float, ...]:
    """(tokens generated, OK requests, TTFT sum and count at the worker, the same at
    the gateway) so far, from the services' /metrics."""
    m = stack.metrics(worker)
    g = stack.metrics(stack.gateway)
    labels = f"model={MODEL},version=1"
    ttft = "inferbus_llm_time_to_first_token_seconds"
    gw_ttft = "inferbus_gateway_gen_time_to_first_token_seconds"
    gw_labels = f"model={MODEL}"
    return (
        m.get(f"inferbus_llm_generated_tokens_total{{{labels}}}", 0.0),
        m.get(f"inferbus_llm_requests_total{{{labels},status=OK}}", 0.0),
        m.get(f"{ttft}_sum{{{labels}}}", 0.0),
        m.get(f"{ttft}_count{{{labels}}}", 0.0),
        sum(v for k, v in g.items() if k.startswith(f"{gw_ttft}_sum{{") and gw_labels in k),
        sum(v for k, v in g.items() if k.startswith(f"{gw_ttft}_count{{") and gw_labels in k),
    )


def _mean_ms(total: float, count: float) -> float:
    return round(total / count * 1000, 1) if count else 0.0


async def measure(stack: LocalStack, worker: ServiceProcess, k: int, max_tokens: int) -> dict:
    url = f"http://{stack.http_url}/v1/chat/completions"
    before = worker_counts(stack, worker)
    cpu0 = cpu_seconds(stack, worker)
    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.monotonic()
        runs = await asyncio.gather(*(one_stream(http, url, max_tokens) for _ in range(k)))
        wall = time.monotonic() - t0
    cpu1 = cpu_seconds(stack, worker)
    after = worker_counts(stack, worker)
    row = summarize("llm-stream", k, max_tokens, wall, runs)
    tokens = max(1, row["client_tokens"])
    for name, t in cpu1.items():
        # CPU per token the client received, by process.
        row[f"{name}_us_per_token"] = round((t - cpu0[name]) / tokens * 1e6, 1)
    row.update(
        worker_tokens=after[0] - before[0],
        worker_ok_requests=after[1] - before[1],
        # Where the client's TTFT goes: from the request reaching the worker, and
        # from the gateway publishing it, to the first token (means).
        worker_ttft_mean_ms=_mean_ms(after[2] - before[2], after[3] - before[3]),
        gateway_ttft_mean_ms=_mean_ms(after[4] - before[4], after[5] - before[5]),
    )
    return row


def engine_only(model_dir: Path, concurrencies: list[int], max_tokens: int, rounds: int) -> None:
    """The limit: the same engine in-process (`LlmEngine`, the worker's wrapper of
    vLLM's AsyncLLM), no bus, no gateway. Runs under ``.venvs/vllm``; prints one
    JSON line per run."""
    from inferbus_common.generation import ChatMessage, GenerationRequest
    from inferbus_common.modelconfig import ModelConfig
    from inferbus_worker.llm.engine import LlmEngine

    config = ModelConfig.model_validate_json((model_dir / "config.json").read_text())
    engine = LlmEngine(config, model_dir / "hf", "cpu")
    engine.start()
    request = GenerationRequest(
        kind="chat",
        messages=[ChatMessage(role="user", content="count to a thousand")],
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    ids = engine.render(request)
    n = 0

    async def one() -> dict[str, float]:
        nonlocal n
        n += 1
        t0 = time.monotonic()
        first = last = 0.0
        tokens = steps = 0
        async for step in engine.generate(f"bench-{n}", request, ids):
            if step.tokens:
                now = time.monotonic()
                first = first or now
                last = now
                tokens += step.tokens
                steps += 1
        return {"ttft_s": first - t0, "last_s": last - t0, "events": steps, "tokens": tokens}

    async def run(k: int) -> dict:
        t0, cpu0 = time.monotonic(), time.process_time()
        runs = await asyncio.gather(*(one() for _ in range(k)))
        row = summarize("llm-engine-only", k, max_tokens, time.monotonic() - t0, runs)
        # vLLM's front end alone (this process: output processing, detokenising),
        # the part of the LLM worker's CPU per event that is not inferbus code.
        cpu = time.process_time() - cpu0
        row["llm_worker_us_per_token"] = round(cpu / max(1, row["client_tokens"]) * 1e6, 1)
        return row

    async def all_runs() -> None:
        await run(1)  # warm-up
        for k in concurrencies:
            for _ in range(rounds):
                print(json.dumps(await run(k)), flush=True)

    try:
        asyncio.run(all_runs())
    finally:
        engine.shutdown(10)


def summarize(bench: str, k: int, max_tokens: int, wall: float, runs: list[dict]) -> dict:
    """One result row from the streams of a run."""
    tokens = sum(r["tokens"] for r in runs)
    events = sum(r["events"] for r in runs)
    return {
        "bench": bench,
        "concurrency": k,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 3),
        "client_tokens": tokens,
        "client_events": events,
        "tokens_per_event": round(tokens / events, 2) if events else 0.0,
        "client_tokens_per_s": round(tokens / wall, 1),
        "client_events_per_s": round(events / wall, 1),
        "ttft_p50_ms": round(statistics.median(r["ttft_s"] for r in runs) * 1000, 1),
        "ttft_max_ms": round(max(r["ttft_s"] for r in runs) * 1000, 1),
        "per_stream_tokens_per_s": round(
            statistics.median(
                r["tokens"] / (r["last_s"] - r["ttft_s"]) for r in runs if r["last_s"] > r["ttft_s"]
            ),
            1,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1, help="runs per concurrency")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-engine-only", action="store_true", help="skip the in-process limit")
    ap.add_argument("--engine-only-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_only_child:
        engine_only(args.engine_only_child, args.concurrency, args.max_tokens, args.rounds)
        return
    from inferbus_testing.llm import build_tiny_llm, start_llm_worker, wait_llm_ready
    from inferbus_testing.stack import LocalStack

    if not VLLM_PYTHON.is_file():
        sys.exit(f"no vLLM environment at {VLLM_PYTHON}: run scripts/bootstrap-llm.sh")
    seqs = max(args.concurrency)
    out = (
        args.out
        or REPO / "bench" / "results" / f"llm-stream-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp:
        base = Path(tmp)
        model_dir = base / MODEL
        build_tiny_llm(model_dir, max_num_seqs=seqs, max_waiting=0, max_len=4096)
        stack = LocalStack(base, workers=0, with_redis=True)
        with stack:
            stack.push(model_dir, MODEL)
            worker = start_llm_worker(stack, base)
            wait_llm_ready(stack, worker, MODEL, timeout=180)
            asyncio.run(measure(stack, worker, 1, 16))  # warm-up
            rows = []
            for k in args.concurrency:
                for _ in range(args.rounds):
                    row = asyncio.run(measure(stack, worker, k, args.max_tokens))
                    row["machine"] = machine_info()
                    rows.append(row)
                    with out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        if not args.no_engine_only:
            # The limit, after the stack is gone (same model files, same cores).
            child = subprocess.run(
                [
                    str(VLLM_PYTHON),
                    __file__,
                    "--engine-only-child",
                    str(model_dir),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--rounds",
                    str(args.rounds),
                    "--concurrency",
                    *map(str, args.concurrency),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            for line in child.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    row["machine"] = machine_info()
                    rows.append(row)
                    with out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    limit = {
        r["concurrency"]: r["client_tokens_per_s"] for r in rows if r["bench"] == "llm-engine-only"
    }
    for row in rows:
        if row["bench"] == "llm-stream" and row["concurrency"] in limit:
            row["of_engine_only"] = round(row["client_tokens_per_s"] / limit[row["concurrency"]], 2)
    cols = [
        "bench",
        "concurrency",
        "client_tokens_per_s",
        "per_stream_tokens_per_s",
        "ttft_p50_ms",
        "gateway_ttft_mean_ms",
        "worker_ttft_mean_ms",
        "client_events_per_s",
        "tokens_per_event",
        "client_tokens",
        "of_engine_only",
        "gateway_us_per_token",
        "llm_worker_us_per_token",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
