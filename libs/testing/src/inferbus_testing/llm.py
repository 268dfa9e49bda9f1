"""The generative side of a `LocalStack`: the tiny offline Llama and an LLM worker.

The LLM worker runs with the interpreter of ``.venvs/vllm``
(``scripts/bootstrap-llm.sh``: vLLM's CPU wheel, kept out of the workspace's
environment); the model is built offline by ``examples/tiny-llm/build.py``
(random weights, a locally trained tokenizer). Used by tests/e2e/test_e2e_llm.py
and bench/llm_stream.py::

    build_tiny_llm(model_dir, max_num_seqs=2, max_waiting=1)
    with LocalStack(base, workers=0, with_redis=True) as stack:
        stack.push(model_dir, TINY_LLM)
        worker = start_llm_worker(stack, base)
        wait_llm_ready(stack, worker)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[4]
VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"
"""The LLM worker's interpreter; its absence is why LLM tests skip."""
TINY_LLM = "tiny-llm"


def build_tiny_llm(
    out: Path, *, max_num_seqs: int, max_waiting: int, max_len: int, layers: int = 2
) -> Path:
    """Build the tiny model into `out` (an inferbus model directory); returns `out`.

    More `layers` make each engine step slower (fewer tokens a second)."""
    subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "examples/tiny-llm/build.py"),
            "--out",
            str(out),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-waiting",
            str(max_waiting),
            "--max-len",
            str(max_len),
            "--layers",
            str(layers),
        ],
        check=True,
        capture_output=True,
    )
    return out


def start_llm_worker(
    stack: LocalStack,
    base: Path,
    name: str = "llm-worker",
    nice: int = 10,
) -> ServiceProcess:
    """Start an LLM worker (CPU) on `stack`, registered in ``stack.procs[name]``.

    `nice` is added to the worker's niceness (vLLM's engine processes inherit it)
    and is the worker's ``nice`` setting (its session's autogroup too, see
    `inferbus_worker.llm.priority`).
    """
    assert stack.nats is not None
    worker = ServiceProcess(
        "inferbus_worker.llm",
        env_prefix="INFERBUS_LLM_",
        python=str(VLLM_PYTHON),
        name=name,
        log_dir=base,
        # vLLM's engine process computes flat out while it generates; on a 2-core
        # test machine at equal priority it starved the gateway, nats-server and
        # the test's client for seconds at a time.
        nice=nice,
        env={
            "INFERBUS_LLM_NATS_URL": stack.nats.url,
            "INFERBUS_LLM_METRICS_PORT": "0",
            "INFERBUS_LLM_REGISTRY_URL": stack.registry_url,
            "INFERBUS_LLM_CACHE_DIR": str(base / f"{name}-cache"),
            "INFERBUS_LLM_DEVICE": "cpu",
            "INFERBUS_LLM_NICE": str(nice),
        },
    )
    stack.procs[name] = worker
    worker.start(timeout=90)
    return worker


def wait_llm_ready(
    stack: LocalStack, worker: ServiceProcess, model: str = TINY_LLM, timeout: float = 150.0
) -> float:
    """Wait until the gateway reports `model` ready; returns the seconds it took.

    Raises:
        RuntimeError: the worker exited, or `timeout` passed (with its log's tail).
    """
    url = f"http://{stack.http_url}/v2/models/{model}/ready"
    t0 = time.monotonic()
    while True:
        if not worker.running:
            raise RuntimeError(f"LLM worker exited:\n{worker.log_tail()}")
        if httpx.get(url, timeout=2).status_code == 200:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{model} not ready after {timeout:.0f} s:\n{worker.log_tail()}")
        time.sleep(0.2)
