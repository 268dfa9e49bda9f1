"""The whole stack through the CLI: `up -d`, `models push`, `infer`, `status`, `down`.

Real processes: nats-server (JetStream), redis-server (when installed) and
every inferbus service, all on ports they pick themselves (``--free-ports``),
read back from their ports files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferbus_cli.__main__ import main
from inferbus_cli.state import is_alive, load_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MAKE_MODEL = REPO / "examples" / "fraud" / "make_model.py"


def cli(home: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `inferbus` in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "inferbus_cli", *argv, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_main(capsys: pytest.CaptureFixture, home: Path, *argv: str) -> tuple[int, str, str]:
    """Run a short command in this process (faster than a new interpreter)."""
    capsys.readouterr()
    rc = main([*argv, "--home", str(home)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def recorded_pids(home: Path) -> list[tuple[int, int]]:
    state = load_state(home)
    return [(p.pid, p.start_ticks) for p in state.processes] if state else []


def kill_leftovers(pids: list[tuple[int, int]]) -> None:
    """Last-resort cleanup so a failing test never leaves services behind."""
    for pid, ticks in pids:
        if is_alive(pid, ticks):
            os.killpg(pid, signal.SIGKILL)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.skipif(not MAKE_MODEL.is_file(), reason="examples/fraud/make_model.py is missing")
def test_detached_stack_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    home = tmp_path / "home"
    up = cli(home, "up", "-d", "--free-ports", "--timeout", "60")
    pids = recorded_pids(home)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "inferbus is up" in up.stdout
        state = load_state(home)
        assert state is not None and state.detached
        names = [p.name for p in state.processes]
        assert names[0] == "nats" and names[-1] == "gateway"
        assert {"registry", "router", "batcher", "worker-1"} <= set(names)
        assert all(is_alive(pid, ticks) for pid, ticks in pids)
        assert (home / "logs" / "gateway.log").is_file()

        again = cli(home, "up", "-d", "--free-ports")
        assert again.returncode == 1
        assert "already running" in again.stderr

        model_dir = tmp_path / "fraud"
        subprocess.run(
            [sys.executable, str(MAKE_MODEL), "--out", str(model_dir)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        push = cli(
            home,
            "models",
            "push",
            str(model_dir),
            "--name",
            "fraud",
            "--version",
            "1",
            "--alias",
            "stable",
        )
        assert push.returncode == 0, push.stderr
        digest = push.stdout.split("digest:")[1].strip()
        assert len(digest) == 64

        rc, out, err = run_main(capsys, home, "models", "list", "--json")
        assert rc == 0, err
        [model] = json.loads(out)
        assert model["name"] == "fraud" and model["versions"] == ["1"]
        assert model["aliases"]["stable"] == "1"

        rc, out, err = run_main(capsys, home, "models", "get", "fraud", "--version", "stable")
        assert rc == 0, err
        assert json.loads(out)["digest"] == digest

        rc, out, err = run_main(capsys, home, "models", "wait", "fraud", "--timeout", "60")
        assert rc == 0, out + err

        rc, out, err = run_main(
            capsys, home, "infer", "fraud", "--random", "3", "--seed", "1", "--compact"
        )
        assert rc == 0, err
        answer = json.loads(out)
        probs = answer["outputs"]["probabilities"]
        assert probs["shape"] == [3, 2]
        assert all(abs(sum(row) - 1.0) < 1e-4 for row in probs["data"])
        assert answer["model_version"] == "1"

        rc, out, err = run_main(capsys, home, "infer", "fraud", "--input", "input=[[1, 2]]")
        assert rc == 1
        assert "INVALID_ARGUMENT" in err

        rc, out, err = run_main(capsys, home, "status", "--json")
        assert rc == 0, out + err
        doc = json.loads(out)
        assert doc["healthy"]
        assert all(p["alive"] for p in doc["processes"])
        [row] = doc["models"]
        assert row["name"] == "fraud" and row["ready"] is True
        assert row["versions_ready"] == {"1": True}

        rc, out, err = run_main(capsys, home, "status")
        assert rc == 0, err
        assert "fraud" in out and "alive" in out

        rc, out, err = run_main(capsys, home, "down")
        assert rc == 0, out + err
        assert not (home / "state.json").exists()
        assert not any(is_alive(pid, ticks) for pid, ticks in pids)
        rc, out, err = run_main(capsys, home, "status")
        assert rc == 1
    finally:
        kill_leftovers(pids)


def test_foreground_stack_reports_a_crash_and_stops_on_down(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferbus_cli",
                "up",
                "--free-ports",
                "--no-redis",
                "--home",
                str(home),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    pids: list[tuple[int, int]] = []
    try:
        wait_for(
            lambda: up.poll() is not None or "press Ctrl-C" in out.read_text(),
            90,
            "the foreground stack",
        )
        assert up.poll() is None, out.read_text()
        state = load_state(home)
        assert state is not None and state.supervisor_pid == up.pid
        pids = recorded_pids(home)
        assert "redis" not in [p.name for p in state.processes]
        router = next(p for p in state.processes if p.name == "router")
        os.kill(router.pid, signal.SIGKILL)
        wait_for(lambda: "router" in out.read_text().split("press Ctrl-C")[1], 10, "crash report")
        wait_for(lambda: "last lines of" in out.read_text(), 10, "the crash's log tail")
        report = out.read_text()
        assert f"router (pid {router.pid}) stopped: killed by SIGKILL" in report

        status = cli(home, "status")
        assert status.returncode == 1
        assert "DEAD" in status.stdout and "router" in status.stderr

        # `down` asks the foreground supervisor to stop (SIGTERM), which stops
        # its children in reverse order and exits 1 since a service crashed.
        down = cli(home, "down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "asking the foreground" in down.stdout
        assert up.wait(timeout=90) == 1
        text = out.read_text()
        assert text.index("stopping gateway") < text.index("stopping nats")
        assert not (home / "state.json").exists()
        assert not any(is_alive(pid, ticks) for pid, ticks in pids)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        kill_leftovers(pids)
