"""scripts/quickstart.sh, run for real against a fresh home on free ports."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from inferbus_cli.state import is_alive, load_state

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "quickstart.sh"


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not on PATH")
def test_quickstart_serves_the_fraud_model(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {
        **os.environ,
        "INFERBUS_HOME": str(home),
        # The test must not install system packages or change the venv.
        "QUICKSTART_SKIP_BOOTSTRAP": "1",
        "UV_NO_SYNC": "1",
        "QUICKSTART_READY_TIMEOUT": "60",
    }
    pids: list[tuple[int, int]] = []
    try:
        run = subprocess.run(
            [str(SCRIPT), "--free-ports"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        state = load_state(home)
        pids = [(p.pid, p.start_ticks) for p in state.processes] if state else []
        assert run.returncode == 0, run.stdout + run.stderr
        assert (home / "example" / "fraud" / "model.onnx").is_file()
        assert run.stdout.count('"probabilities"') == 3
        assert state is not None
        assert f"{state.endpoints['gateway_http']}/v2/models/fraud/infer" in run.stdout
        if (REPO / ".venv" / "bin" / "inferbus-edge").is_file():
            assert f"gRPC edge      : {state.endpoints['edge_grpc']}" in run.stdout
        assert "curl" in run.stdout and "uv run inferbus down" in run.stdout
    finally:
        subprocess.run(
            ["uv", "run", "inferbus", "down"], cwd=REPO, env=env, capture_output=True, timeout=120
        )
    assert not any(is_alive(pid, ticks) for pid, ticks in pids)
