"""`inferbus up` with the vLLM environment: an LLM worker and the tiny model too.

The plan tests are pure. The stack test starts the real stack with ``up -d``
(skipped, with the reason, without ``.venvs/vllm``), checks that
``GET /v1/models`` lists ``tiny-llm`` and that a chat completion is served, then
stops it with ``down``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from inferbus_cli.llm import REPO, TINY_MODEL, find_vllm_python
from inferbus_cli.plan import Ports, UpOptions, process_names, service_spec
from inferbus_cli.state import is_alive, load_state

VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"


def test_plan_adds_the_llm_worker_with_its_own_interpreter(tmp_path: Path) -> None:
    python = tmp_path / "python"
    options = UpOptions(home=tmp_path, ports=Ports(), llm_python=python)
    names = process_names(options, with_redis=False)
    assert "llm-worker" in names
    assert names[-1] == "gateway"
    spec = service_spec(options, "llm-worker", {"nats": "nats://x:1", "registry": "r:2"})
    assert spec.argv == [str(python), "-m", "inferbus_worker.llm"]
    assert spec.env["INFERBUS_LLM_POOL"] == "llm"
    assert spec.env["INFERBUS_LLM_REGISTRY_URL"] == "r:2"
    assert spec.env["INFERBUS_LLM_METRICS_PORT"] == "8052"
    plain = UpOptions(home=tmp_path)
    assert "llm-worker" not in process_names(plain, with_redis=False)


def test_find_vllm_python_honours_the_environment(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    assert find_vllm_python({"INFERBUS_VLLM_PYTHON": str(python)}) == python
    assert find_vllm_python({"INFERBUS_VLLM_PYTHON": "off"}) is None
    assert find_vllm_python({"INFERBUS_VLLM_PYTHON": str(tmp_path / "missing")}) is None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason=f"no {VLLM_PYTHON}: run scripts/bootstrap-llm.sh"
)
def test_up_serves_the_tiny_generative_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERBUS_VLLM_PYTHON", str(VLLM_PYTHON))
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "inferbus_cli"]
    up = subprocess.run(
        [*cmd, "up", "-d", "--free-ports", "--timeout", "90", "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    state = load_state(home)
    pids = [(p.pid, p.start_ticks) for p in state.processes] if state else []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"pushed {TINY_MODEL}" in up.stdout
        assert state is not None
        assert "llm-worker" in [p.name for p in state.processes]
        base = state.endpoints["gateway_http"]
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        assert TINY_MODEL in [m["id"] for m in models["data"]]

        deadline = time.monotonic() + 180
        while httpx.get(f"{base}/v2/models/{TINY_MODEL}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "tiny-llm never became ready"
            time.sleep(0.5)
        with openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0) as client:
            out = client.chat.completions.create(
                model=TINY_MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
        assert out.usage is not None and out.usage.completion_tokens == 4
    finally:
        down = subprocess.run(
            [*cmd, "down", "--home", str(home)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        for pid, ticks in pids:
            if is_alive(pid, ticks):
                os.killpg(pid, signal.SIGKILL)
    assert down.returncode == 0, down.stdout + down.stderr
