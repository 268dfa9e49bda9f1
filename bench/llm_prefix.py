"""Prefix-aware placement A/B: two LLM workers of one version, a workload whose
prompts share long prefixes, the router's placement on and off.

Starts the e2e stack (nats-server, registry, router, batcher, gateway, Redis;
no tensor workers) and two LLM workers from ``.venvs/vllm`` serving the tiny
offline Llama (``examples/tiny-llm/build.py``). The workload: `--groups`
system prompts of `--prefix-chars` characters, `--per-group` questions each,
shuffled (fixed seed) and sent as streamed ``/v1/completions`` with
`--concurrency` in flight. Arms alternate (on, off, off, on, ...): for each,
the router is restarted with ``INFERBUS_ROUTER_PREFIX_PLACEMENT`` set, and
every request's prompt is new to the engines (a per-round salt in front of
every prefix), so the caches start cold. Recorded per arm: the engines' prefix
cache hit rate (``inferbus_llm_prefix_cache_{hit,queried}_tokens_total`` of
both workers), the router's placements, and TTFT as the client saw it.

    uv run python bench/llm_prefix.py --rounds 2

One JSON line per arm and round to ``bench/results/llm-prefix-<time>.jsonl``;
a Markdown table of the medians is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from inferbus_testing.processes import ServiceProcess
    from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llm"
WORDS = (
    "the platform serves models over a bus with workers that batch requests and "
    "stream tokens while operators watch queues latency and caches on every host"
).split()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import machine_info  # noqa: E402


def workload(groups: int, per_group: int, prefix_chars: int, salt: str, seed: int) -> list[str]:
    """Prompts: per group a shared prefix of `prefix_chars`, then a short question."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        words: list[str] = []
        while len(" ".join(words)) < prefix_chars:
            words.append(rng.choice(WORDS))
        prefix = f"{salt} system prompt {g}: " + " ".join(words)[:prefix_chars]
        for q in range(per_group):
            prompts.append(f"{prefix}\nquestion {q}: {rng.choice(WORDS)} {rng.choice(WORDS)}?")
    rng.shuffle(prompts)
    return prompts


async def one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> float:
    """Seconds to the first token of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.monotonic()
    first = 0.0
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if first or not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                first = time.monotonic() - t0
    return first


async def drive(
    base_url: str, prompts: list[str], concurrency: int, max_tokens: int
) -> list[float]:
    url = f"{base_url}/v1/completions"
    todo = list(prompts)
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=120) as http:

        async def client() -> None:
            while todo:
                ttfts.append(await one(http, url, todo.pop(), max_tokens))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts


def counters(stack: LocalStack, workers: list[ServiceProcess]) -> dict[str, float]:
    hit = queried = 0.0
    for w in workers:
        m = stack.metrics(w)
        for key, value in m.items():
            if key.startswith("inferbus_llm_prefix_cache_hit_tokens_total{"):
                hit += value
            elif key.startswith("inferbus_llm_prefix_cache_queried_tokens_total{"):
                queried += value
    r = stack.metrics(stack.router)
    placed = {
        outcome: sum(
            v
            for k, v in r.items()
            if k.startswith("inferbus_router_prefix_placements_total{")
            and f"outcome={outcome}" in k
        )
        for outcome in ("hit", "new", "fallback")
    }
    return {"hit": hit, "queried": queried, **{f"placed_{k}": v for k, v in placed.items()}}


def wait_ready_workers(stack: LocalStack, count: int, timeout: float = 300.0) -> None:
    """Until `count` LLM workers report the model ready (the gateway's readiness
    needs only one)."""
    import nats

    from inferbus_common.catalog import Catalog
    from inferbus_common.subjects import Subjects

    async def wait() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            async with Catalog(nc.jetstream(), Subjects()) as catalog:
                await catalog.wait_loaded()
                ok = await catalog.wait_for(
                    lambda: len(catalog.ready_workers(MODEL, "1")) >= count, timeout
                )
                if not ok:
                    raise RuntimeError(f"{count} ready LLM workers not seen in {timeout:.0f} s")
        finally:
            await nc.close()

    asyncio.run(wait())


def restart_router(stack: LocalStack, placement: bool) -> None:
    stack.router.terminate()
    stack._spawn(
        "router",
        "inferbus_router",
        {"INFERBUS_ROUTER_PREFIX_PLACEMENT": "true" if placement else "false"},
    )
    stack.router.wait_ready()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-chars", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA pairs")
    ap.add_argument("--layers", type=int, default=4, help="of the tiny model (prefill cost)")
    args = ap.parse_args()
    from inferbus_testing.llm import VLLM_PYTHON, build_tiny_llm, start_llm_worker, wait_llm_ready
    from inferbus_testing.stack import LocalStack

    if not VLLM_PYTHON.is_file():
        sys.exit(f"no vLLM environment at {VLLM_PYTHON}: run scripts/bootstrap-llm.sh")
    out = REPO / "bench" / "results" / f"llm-prefix-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="llm-prefix-") as tmp:
        base = Path(tmp)
        model_dir = base / MODEL
        build_tiny_llm(
            model_dir,
            max_num_seqs=args.concurrency,
            max_waiting=args.concurrency,
            max_len=4096,
            layers=args.layers,
        )
        with LocalStack(base, workers=0, with_redis=True) as stack:
            stack.push(model_dir, MODEL)
            workers = [start_llm_worker(stack, base, name=f"llm-{i}") for i in range(2)]
            for w in workers:
                wait_llm_ready(stack, w, MODEL, timeout=240)
            wait_ready_workers(stack, len(workers))
            http_url = f"http://{stack.http_url}"
            asyncio.run(drive(http_url, workload(2, 2, 200, "warm", 0), 2, 2))
            arms = []
            for r in range(args.rounds):
                arms += [True, False] if r % 2 == 0 else [False, True]
            for i, placement in enumerate(arms):
                restart_router(stack, placement)
                time.sleep(1.0)  # the router's catalog sees both workers
                prompts = workload(
                    args.groups, args.per_group, args.prefix_chars, f"r{i}", seed=i // 2
                )
                before = counters(stack, workers)
                t0 = time.monotonic()
                ttfts = asyncio.run(drive(http_url, prompts, args.concurrency, args.max_tokens))
                wall = time.monotonic() - t0
                after = counters(stack, workers)
                d = {k: after[k] - before[k] for k in after}
                ttfts.sort()
                row = {
                    "bench": "llm-prefix",
                    "placement": placement,
                    "arm": i,
                    "requests": len(ttfts),
                    "hit_rate": round(d["hit"] / d["queried"], 3) if d["queried"] else 0.0,
                    "placed_hit": d["placed_hit"],
                    "placed_new": d["placed_new"],
                    "placed_fallback": d["placed_fallback"],
                    "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
                    "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000, 1),
                    "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 1),
                    "requests_per_s": round(len(ttfts) / wall, 2),
                    "command": " ".join(sys.argv),
                    "machine": machine_info(),
                }
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if k != "machine"}), flush=True)
    cols = ["hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms", "requests_per_s"]
    print("| placement | " + " | ".join(cols) + " | placed hit/new/fallback |")
    print("|---|" + "---|" * len(cols) + "---|")
    for placement in (False, True):
        mine = [r for r in rows if r["placement"] is placement]
        med = {c: statistics.median(r[c] for r in mine) for c in cols}
        placed = "/".join(
            str(int(sum(r[f"placed_{k}"] for r in mine))) for k in ("hit", "new", "fallback")
        )
        print(
            f"| {'on' if placement else 'off'} | "
            + " | ".join(str(med[c]) for c in cols)
            + f" | {placed} |"
        )
    print(f"rows: {out}")


if __name__ == "__main__":
    main()
