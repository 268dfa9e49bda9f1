"""vLLM's own server against inferbus, measured by vLLM's own client (`vllm bench serve`).

Builds the tiny offline Llama once and serves it twice, with the same engine
settings (``max_num_seqs``, ``max_model_len``, dtype, eager, seed, the KV cache
size, the same niceness): through inferbus (the e2e stack: nats-server,
registry, router, gateway, one LLM worker from ``.venvs/vllm``) and through
``vllm serve`` (the OpenAI server vLLM ships, same interpreter). Then, for each
scenario (backend ``openai`` = /v1/completions and ``openai-chat`` =
/v1/chat/completions, each at a fixed request rate, at a fixed concurrency and
at an unbounded rate), it runs ``vllm bench serve`` once against each server,
alternating which goes first, and records TTFT p50/p99, output tokens/s, ITL
p50 and served/total. Both servers stay up for the whole run (an idle engine
takes no CPU), so the arms see the same machine within seconds of each other.
One JSON line per run goes to ``bench/results/llm-vs-vllm-<time>.jsonl``; a
Markdown table with the ratios is printed (``--markdown FILE`` writes it too).

    uv run python bench/llm_vs_vllm.py --rounds 1 --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from cpu_window import take_snapshot

from inferbus_testing.llm import TINY_LLM, build_tiny_llm, start_llm_worker, wait_llm_ready
from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[1]
VLLM_BIN = REPO / ".venvs" / "vllm" / "bin" / "vllm"
RESULTS = REPO / "bench" / "results"
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_session_nice(pid: int, nice: int) -> None:
    """Set the autogroup niceness of `pid`'s session (Linux groups processes by session)."""
    path = Path(f"/proc/{pid}/autogroup")
    if path.exists():
        path.write_text(str(nice))


def _nice(n: int) -> Any:
    # As the LLM worker does for itself (`inferbus_worker.llm.priority`): the
    # process and, as the leader of its new session, the session's autogroup.
    def pre() -> None:
        if n:
            os.nice(n)
            set_session_nice(os.getpid(), n)

    return pre


def start_vllm_server(
    hf_dir: Path, port: int, log: Path, *, max_num_seqs: int, max_len: int, nice: int
) -> subprocess.Popen[bytes]:
    """``vllm serve`` on the tiny model with the settings the LLM worker gives vLLM.

    The worker's `engine_options`/`engine_environment` for a CPU version: dtype
    float32 (the model's), eager, seed 0, ``VLLM_CPU_KVCACHE_SPACE`` 1 GiB, the
    version's ``max_num_seqs`` and ``max_model_len``; started in a session of its
    own at the same niceness as the test harness starts the worker.
    """
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    cmd = [
        str(VLLM_BIN),
        "serve",
        str(hf_dir),
        "--served-model-name",
        TINY_LLM,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--enforce-eager",
        "--seed",
        "0",
    ]
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_nice(nice),  # as the harness starts the LLM worker
        )


def stop_vllm_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM `vllm serve`; SIGKILL it if it has not exited after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_vllm_ready(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float) -> None:
    """Until vLLM's server answers /health (raises with its log's tail otherwise)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def bench_command(
    base_url: str, backend: str, hf_dir: Path, args: argparse.Namespace, scenario: str
) -> list[str]:
    """The `vllm bench serve` command line of one run (both arms get the same one)."""
    cmd = [
        str(VLLM_BIN),
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        base_url,
        "--endpoint",
        BACKENDS[backend],
        "--model",
        TINY_LLM,
        "--tokenizer",
        str(hf_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]
    if scenario == "rate":
        cmd += ["--request-rate", str(args.rate)]
    elif scenario == "concurrency":
        cmd += ["--request-rate", "inf", "--max-concurrency", str(args.concurrency)]
    else:
        cmd += ["--request-rate", "inf"]
    return cmd


def run_one(cmd: list[str], out_dir: Path, name: str) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result, with what we compare."""
    full = [*cmd, "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(full, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    raw = json.loads((out_dir / name).read_text())
    return {
        "completed": raw["completed"],
        "total": raw["num_prompts"],
        "failed": raw.get("failed", raw["num_prompts"] - raw["completed"]),
        "ttft_p50_ms": raw["p50_ttft_ms"],
        "ttft_p99_ms": raw["p99_ttft_ms"],
        "ttft_mean_ms": raw["mean_ttft_ms"],
        "itl_p50_ms": raw["p50_itl_ms"],
        "itl_p99_ms": raw["p99_itl_ms"],
        "tpot_p50_ms": raw["p50_tpot_ms"],
        "output_tok_s": raw["output_throughput"],
        "duration_s": raw["duration"],
    }


SCENARIOS = ("rate", "concurrency", "unbounded")
ENGINE_SERIES = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "inferbus_llm_event_loop_lag_seconds",
    "inferbus_llm_time_to_first_token_seconds",
    "inferbus_gateway_gen_time_to_first_token_seconds",
)


def engine_sums(metrics_urls: list[str]) -> dict[str, float]:
    """Sums and counts of vLLM's own TTFT and queue-time histograms (and, in the
    LLM worker, its event-loop lag) from a /metrics page: the engine's side of a run.

    vLLM measures TTFT from the request's arrival in its front end (``AsyncLLM``)
    to the first token's output, so the difference between the client's TTFT and
    this is what the serving path around the engine adds.
    """
    text = "\n".join(httpx.get(url, timeout=10).text for url in metrics_urls)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        for series in ENGINE_SERIES:
            for part in ("_sum", "_count"):
                if base == series + part:
                    out[base] = out.get(base, 0.0) + float(value)
        if base == "inferbus_llm_event_loop_lag_seconds_bucket" and 'le="0.02"' in name:
            out["lag_le_20ms"] = float(value)
    return out


def engine_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Means over one run: engine TTFT and queue time (ms), loop-lag samples over 20 ms."""

    def mean_ms(series: str) -> float:
        n = after.get(series + "_count", 0.0) - before.get(series + "_count", 0.0)
        s = after.get(series + "_sum", 0.0) - before.get(series + "_sum", 0.0)
        return round(s / n * 1000, 2) if n else float("nan")

    lag = "inferbus_llm_event_loop_lag_seconds"
    out = {
        "engine_ttft_mean_ms": mean_ms("vllm:time_to_first_token_seconds"),
        "engine_queue_mean_ms": mean_ms("vllm:request_queue_time_seconds"),
    }
    if "inferbus_gateway_gen_time_to_first_token_seconds_count" in after:
        # The worker's (request received → first step) and the gateway's (request
        # received → first chunk in) TTFT: where on the path the first token waits.
        out["worker_ttft_mean_ms"] = mean_ms("inferbus_llm_time_to_first_token_seconds")
        out["gateway_ttft_mean_ms"] = mean_ms("inferbus_gateway_gen_time_to_first_token_seconds")
    if lag + "_count" in after:
        samples = after[lag + "_count"] - before.get(lag + "_count", 0.0)
        over = samples - (after.get("lag_le_20ms", 0.0) - before.get("lag_le_20ms", 0.0))
        out["worker_loop_lag_mean_ms"] = mean_ms(lag)
        out["worker_loop_lag_over_20ms"] = over
    return out


def cpu_per_token(before: Any, after: Any, tokens: float) -> dict[str, Any]:
    """CPU µs per output token of each server process group over one run.

    ``before``/``after`` are `cpu_window.take_snapshot`s of the arm's processes
    (inferbus: gateway, router, nats-server, the LLM worker with its engine
    core; vLLM: its server's whole tree). The server side's CPU is what the
    engine shares the machine's cores with.
    """
    out: dict[str, float] = {}
    processes: dict[str, float] = {}
    for name, now in after.procs.items():
        then = before.procs.get(name, {})
        ticks = 0
        for pid, (comm, t) in now.items():
            used = t - then.get(pid, (comm, 0))[1]
            ticks += used
            if used and tokens:
                processes[f"{name}/{comm}[{pid}]"] = round(1e6 * used / after.hz / tokens, 1)
        out[name] = round(1e6 * ticks / after.hz / tokens, 1) if tokens else float("nan")
    return {
        "cpu_us_per_token": out,
        "cpu_us_per_token_total": round(sum(out.values()), 1),
        "cpu_us_per_token_by_process": processes,
    }


def scenario_label(scenario: str, args: argparse.Namespace) -> str:
    """How a scenario reads in the table."""
    if scenario == "rate":
        return f"{args.rate:g} req/s"
    if scenario == "concurrency":
        return f"concurrency {args.concurrency}"
    return "unbounded rate"


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Markdown: per backend and scenario, both arms (medians over rounds) and the ratios.

    The reference arm is vLLM's server, or with ``--ab-session-nice`` the first arm.
    """
    names = list(dict.fromkeys(r["arm"] for r in rows))
    if "vllm" in names:
        names = ["vllm", *[n for n in names if n != "vllm"]]
    ref = "vLLM's" if names and names[0] == "vllm" else (names[0] if names else "")
    out = [
        "| backend | scenario | arm | TTFT p50 ms | TTFT p99 ms | output tok/s | ITL p50 ms "
        "| served |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for backend in args.backends:
        for scenario in SCENARIOS:
            arms: dict[str, dict[str, float]] = {}
            for arm in names:
                runs = [
                    r
                    for r in rows
                    if r["backend"] == backend and r["scenario"] == scenario and r["arm"] == arm
                ]
                if not runs:
                    continue
                med = {
                    k: statistics.median(r[k] for r in runs)
                    for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "itl_p50_ms")
                }
                med["completed"] = sum(r["completed"] for r in runs)
                med["total"] = sum(r["total"] for r in runs)
                arms[arm] = med
                out.append(
                    f"| {backend} | {scenario_label(scenario, args)} | {arm} "
                    f"| {med['ttft_p50_ms']:.1f} | {med['ttft_p99_ms']:.1f} "
                    f"| {med['output_tok_s']:.1f} | {med['itl_p50_ms']:.2f} "
                    f"| {med['completed']:.0f}/{med['total']:.0f} |"
                )
            if len(arms) == 2:
                v, i = (arms[n] for n in names)
                itl = (
                    f"{i['itl_p50_ms'] / v['itl_p50_ms']:.2f}"
                    if v["itl_p50_ms"] >= 0.05
                    else f"n/a ({i['itl_p50_ms']:.2f} / {v['itl_p50_ms']:.2f} ms)"
                )
                checks.append(
                    f"| {backend} | {scenario_label(scenario, args)} "
                    f"| {i['ttft_p50_ms'] - v['ttft_p50_ms']:+.1f} "
                    f"| {i['ttft_p99_ms'] / v['ttft_p99_ms']:.2f} "
                    f"| {i['output_tok_s'] / v['output_tok_s']:.2f} "
                    f"| {itl} "
                    f"| {i['completed']:.0f}/{i['total']:.0f} |"
                )
    out += [
        "",
        f"| backend | scenario | TTFT p50 − {ref} (target ≤ +15 ms) | TTFT p99 ÷ {ref} "
        f"(≤ 1.5) | output tok/s ÷ {ref} (≥ 0.95) | ITL p50 ÷ {ref} (0.8–1.2) "
        f"| {names[-1] if names else ''} served |",
        "|---|---|---|---|---|---|---|",
        *checks,
    ]
    return "\n".join(out)


def run_all(
    args: argparse.Namespace,
    urls: dict[str, str],
    metrics: dict[str, list[str]],
    hf_dir: Path,
    base: Path,
    out_path: Path,
    rows: list[dict[str, Any]],
    pids: dict[str, dict[str, int]] | None = None,
) -> None:
    """Every round, backend and scenario against both arms, alternating which goes first.

    With ``--ab-session-nice A B`` the arms are the inferbus stack with its LLM
    worker's session at autogroup niceness A and B, switched before each run.
    """
    arms = list(urls)
    k = 0
    for rnd in range(args.rounds):
        for backend in args.backends:
            for scenario in args.scenarios:
                order = arms if k % 2 == 0 else arms[::-1]
                k += 1
                for arm in order:
                    if args.ab_session_nice:
                        set_session_nice(args.worker_pid, int(arm.rsplit("-", 1)[1]))
                    cmd = bench_command(urls[arm], backend, hf_dir, args, scenario)
                    load = os.getloadavg()[0]
                    e0 = engine_sums(metrics[arm])
                    c0 = take_snapshot((pids or {}).get(arm, {}))
                    result = run_one(cmd, base, f"{arm}-{backend}-{scenario}-{rnd}.json")
                    c1 = take_snapshot((pids or {}).get(arm, {}))
                    result.update(engine_delta(e0, engine_sums(metrics[arm])))
                    tokens = result["output_tok_s"] * result["duration_s"]
                    result.update(cpu_per_token(c0, c1, tokens))
                    row = {
                        "arm": arm,
                        "backend": backend,
                        "scenario": scenario,
                        "round": rnd,
                        "load1": round(load, 2),
                        **result,
                        "command": " ".join(cmd)
                        .replace(str(hf_dir), "<tiny-llm>/hf")
                        .replace(urls[arm], f"<{arm}>")
                        .replace(f"{REPO}/", ""),
                    }
                    rows.append(row)
                    with out_path.open("a") as fh:
                        fh.write(json.dumps(row) + "\n")
                    print(
                        f"{arm:8} {backend:11} {scenario:11} r{rnd} "
                        f"ttft p50 {row['ttft_p50_ms']:.1f} p99 {row['ttft_p99_ms']:.1f} ms, "
                        f"{row['output_tok_s']:.0f} tok/s, itl p50 {row['itl_p50_ms']:.2f} ms, "
                        f"{row['completed']}/{row['total']} (load {load:.1f}); engine ttft "
                        f"mean {row['engine_ttft_mean_ms']:.1f} ms, queue "
                        f"{row['engine_queue_mean_ms']:.1f} ms, worker loop lag "
                        f"{row.get('worker_loop_lag_mean_ms', '-')} ms; worker ttft "
                        f"{row.get('worker_ttft_mean_ms', '-')}, gateway ttft "
                        f"{row.get('gateway_ttft_mean_ms', '-')} ms; CPU µs/token "
                        f"{row['cpu_us_per_token_total']} {row['cpu_us_per_token_by_process']}",
                        file=sys.stderr,
                        flush=True,
                    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="runs per scenario and arm")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0, help="the fixed-rate scenario's req/s")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="inferbus' waiting bound per worker (vLLM's server queues without one)",
    )
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2, help="the tiny model's depth")
    ap.add_argument("--nice", type=int, default=10, help="niceness of both servers' engines")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument(
        "--ab-session-nice",
        type=int,
        nargs=2,
        default=None,
        metavar=("A", "B"),
        help="instead of vLLM: inferbus with its LLM worker's session at autogroup nice A vs B",
    )
    ap.add_argument(
        "--ab-frames",
        action="store_true",
        help="instead of vLLM: inferbus with chunk frames (its gateway) against one message "
        "per chunk (a second gateway on the same stack)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    ap.add_argument(
        "--table", type=Path, default=None, help="only print the tables of a results file"
    )
    args = ap.parse_args()
    if args.table is not None:
        print(table([json.loads(line) for line in args.table.read_text().splitlines()], args))
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = args.out or RESULTS / f"llm-vs-vllm-{stamp}.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llm-vs-vllm-") as tmp:
        base = Path(tmp)
        model_dir = build_tiny_llm(
            base / TINY_LLM,
            max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting,
            max_len=args.max_len,
            layers=args.layers,
        )
        hf_dir = model_dir / "hf"
        port = _free_port()
        vlog = base / "vllm-serve.log"
        server = (
            None
            if args.ab_session_nice or args.ab_frames
            else start_vllm_server(
                hf_dir,
                port,
                vlog,
                max_num_seqs=args.max_num_seqs,
                max_len=args.max_len,
                nice=args.nice,
            )
        )
        try:
            with LocalStack(base, workers=0, with_redis=True) as stack:
                stack.push(model_dir, TINY_LLM)
                worker = start_llm_worker(stack, base, nice=args.nice)
                wait_llm_ready(stack, worker, TINY_LLM)
                if server is not None:
                    wait_vllm_ready(server, port, vlog, timeout=300)
                urls = {"inferbus": f"http://{stack.http_url}", "vllm": f"http://127.0.0.1:{port}"}
                metrics = {
                    "inferbus": [
                        f"http://127.0.0.1:{worker.ports['metrics']}/metrics",
                        f"http://127.0.0.1:{stack.gateway.ports['metrics']}/metrics",
                    ],
                    "vllm": [f"http://127.0.0.1:{port}/metrics"],
                }
                if args.ab_session_nice:
                    # No vLLM server: the inferbus stack against itself, the worker's
                    # session at one autogroup niceness and then the other.
                    args.worker_pid = worker.pid
                    urls = {f"session-nice-{n}": urls["inferbus"] for n in args.ab_session_nice}
                    metrics = {arm: metrics["inferbus"] for arm in urls}
                inferbus_pids = {
                    "gateway": stack.gateway.pid or 0,
                    "router": stack.router.pid or 0,
                    "nats-server": stack.nats.pid if stack.nats is not None else 0,
                    "llm-worker": worker.pid or 0,
                }
                pids = {arm: inferbus_pids for arm in urls if arm != "vllm"}
                if args.ab_frames:
                    # No vLLM server: a second gateway on the same bus, router and
                    # worker, asking for one message per chunk; the arms alternate.
                    single = stack._spawn(
                        "gateway-single",
                        "inferbus_gateway",
                        {
                            "INFERBUS_GATEWAY_HTTP_PORT": "0",
                            "INFERBUS_GATEWAY_GRPC_PORT": "0",
                            "INFERBUS_GATEWAY_GENERATION_CHUNK_FRAMES": "false",
                        },
                    )
                    single.wait_ready()
                    single_url = f"http://127.0.0.1:{single.ports['http']}"
                    t0 = time.monotonic()
                    while httpx.get(f"{single_url}/v2/models/{TINY_LLM}/ready").status_code != 200:
                        if time.monotonic() - t0 > 60:
                            raise RuntimeError("the second gateway never saw the model ready")
                        time.sleep(0.2)
                    urls = {"single": single_url, "frames": urls["inferbus"]}
                    metrics = {
                        "single": [
                            metrics["inferbus"][0],
                            f"http://127.0.0.1:{single.ports['metrics']}/metrics",
                        ],
                        "frames": metrics["inferbus"],
                    }
                    pids = {
                        "frames": inferbus_pids,
                        "single": {**inferbus_pids, "gateway": single.pid or 0},
                    }
                if server is not None:
                    pids["vllm"] = {"vllm-serve": server.pid}
                print("servers:", urls, file=sys.stderr)
                run_all(args, urls, metrics, hf_dir, base, out_path, rows, pids)
        finally:
            if server is not None:
                stop_vllm_server(server)
    text = table(rows, args)
    print(text)
    print(f"\nresults: {out_path}", file=sys.stderr)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
