"""What one short generative request costs the platform: CPU per request by process.

Starts the e2e stack (nats-server, registry, router, batcher, gateway, Redis; no
tensor workers) and one LLM worker from ``.venvs/vllm`` serving the tiny offline
Llama, then keeps `--concurrency` streamed ``/v1/completions`` of `--max-tokens`
tokens in flight (httpx, one process) for `--requests` requests per round.
Recorded per round: requests/s and the CPU µs per request of the gateway,
router, nats-server, redis-server and the LLM worker (its own process; vLLM's
engine processes are left out: they cost the same on either arm).

Arms, alternating (a, b, c, a, b, c, ...):

* ``direct``: the gateway as configured by default (a request on a plain route
  to a version one LLM worker serves goes straight to the worker), a fresh
  stack per round;
* ``router``: ``INFERBUS_GATEWAY_DIRECT_DISPATCH=false`` (every request through
  the router, as before direct dispatch of generative requests), likewise;
* ``vllm``: vLLM's own OpenAI server (``vllm serve``, the same engine settings
  as `llm_vs_vllm.py`, started once): the CPU of its API-server process, which
  does what inferbus' gateway, bus and LLM worker process do together.

    uv run python bench/llm_request_cost.py --rounds 3

One JSON line per arm and round to ``bench/results/llm-request-cost-<time>.jsonl``;
a Markdown table of the medians is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from cpu_window import proc_cpu_s
from llm_vs_vllm import _free_port, start_vllm_server, stop_vllm_server, wait_vllm_ready

from inferbus_testing.llm import TINY_LLM, build_tiny_llm, start_llm_worker, wait_llm_ready
from inferbus_testing.stack import LocalStack

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = {"direct": {}, "router": {"INFERBUS_GATEWAY_DIRECT_DISPATCH": "false"}, "vllm": {}}


async def load(url: str, n: int, concurrency: int, max_tokens: int) -> None:
    """`n` streamed completions, `concurrency` at a time; every one must answer 200."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            body = {
                "model": TINY_LLM,
                "prompt": f"request {i}: " + "hello " * 8,
                "max_tokens": max_tokens,
                "stream": True,
            }
            async with gate, client.stream("POST", "/v1/completions", json=body) as answer:
                async for _ in answer.aiter_bytes():
                    pass
                if answer.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {answer.status_code}")

        await asyncio.gather(*(one(i) for i in range(n)))


def measure(url: str, pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then one measured window: req/s and CPU µs per request by process."""
    asyncio.run(load(url, args.warmup, args.concurrency, args.max_tokens))
    before = {name: proc_cpu_s(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    asyncio.run(load(url, args.requests, args.concurrency, args.max_tokens))
    elapsed = time.monotonic() - t0
    cpu = {
        name: round(1e6 * (proc_cpu_s(pid) - before[name]) / args.requests, 1)
        for name, pid in pids.items()
    }
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "req_s": round(args.requests / elapsed, 1),
        "cpu_us_per_request": cpu,
        "platform_us_per_request": round(
            sum(v for k, v in cpu.items() if k not in ("llm-worker", "vllm-api-server")), 1
        ),
        "front_end_us_per_request": round(sum(cpu.values()), 1),
    }


def run_inferbus(arm: str, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """One round of an inferbus arm on a fresh stack."""
    saved = {k: os.environ.get(k) for k in ARMS[arm]}
    os.environ.update(ARMS[arm])
    try:
        with LocalStack(base / arm, workers=0, with_redis=True) as stack:
            stack.push(args.model_dir, TINY_LLM)
            worker = start_llm_worker(stack, base / arm, nice=10)
            wait_llm_ready(stack, worker, TINY_LLM)
            assert stack.nats is not None and stack.redis is not None
            pids = {
                "gateway": stack.gateway.pid or 0,
                "router": stack.router.pid or 0,
                "nats-server": stack.nats.pid or 0,
                "redis-server": stack.redis.pid or 0,
                "llm-worker": worker.pid or 0,
            }
            return {"arm": arm, **measure(f"http://{stack.http_url}", pids, args)}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def table(rows: list[dict[str, Any]]) -> str:
    """Medians per arm: req/s and CPU µs per request by process."""
    names = ["gateway", "router", "nats-server", "redis-server", "llm-worker", "vllm-api-server"]
    head = " | ".join(f"{n} µs/req" for n in names)
    out = [
        f"| arm | rounds | req/s | {head} | platform µs/req | front end µs/req |",
        "|---|---:|---:|" + "---:|" * (len(names) + 2),
    ]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        cells = [f"{statistics.median(r['req_s'] for r in mine):,.0f}"]
        cells += [
            f"{statistics.median(r['cpu_us_per_request'].get(n, 0.0) for r in mine):,.0f}"
            for n in names
        ]
        for key in ("platform_us_per_request", "front_end_us_per_request"):
            cells.append(f"{statistics.median(r[key] for r in mine):,.0f}")
        out.append(f"| {arm} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    out_path = RESULTS / f"llm-request-cost-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llm-request-cost-") as tmp:
        base = Path(tmp)
        args.model_dir = build_tiny_llm(
            base / TINY_LLM, max_num_seqs=16, max_waiting=256, max_len=1024, layers=2
        )
        server = None
        if "vllm" in args.arms:
            port = _free_port()
            log = base / "vllm-serve.log"
            server = start_vllm_server(
                args.model_dir / "hf", port, log, max_num_seqs=16, max_len=1024, nice=10
            )
        try:
            if server is not None:
                wait_vllm_ready(server, port, log, timeout=300)
            for rnd in range(args.rounds):
                for arm in args.arms:
                    if arm == "vllm":
                        assert server is not None
                        pids = {"vllm-api-server": server.pid}
                        row = {"arm": arm, **measure(f"http://127.0.0.1:{port}", pids, args)}
                    else:
                        row = run_inferbus(arm, args, base / f"r{rnd}")
                    row["round"] = rnd
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    with out_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            if server is not None:
                stop_vllm_server(server)
    print(table(rows))
    print(f"results: {out_path}")


if __name__ == "__main__":
    main()
