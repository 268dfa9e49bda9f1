"""Starting, probing and stopping real child processes (fast ones, no services)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from inferbus_cli.__main__ import main
from inferbus_cli.plan import ProcessSpec
from inferbus_cli.state import is_alive, process_start_ticks
from inferbus_cli.supervisor import StartupError, describe_exit, launch, stop_pid, wait_up


def python_spec(tmp_path: Path, name: str, code: str) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        kind="service",
        argv=[sys.executable, "-c", code],
        env={"IB_TEST_MARKER": "1"},
        log=tmp_path / "logs" / f"{name}.log",
        ports_file=tmp_path / "run" / f"{name}.json",
    )


def test_a_process_that_exits_during_startup_is_reported(tmp_path: Path) -> None:
    code = (
        "import os, sys; print('bad config: NATS_URL', os.environ['IB_TEST_MARKER']); sys.exit(3)"
    )
    child = launch(python_spec(tmp_path, "registry", code))
    with pytest.raises(StartupError) as exc:
        wait_up(child, tmp_path / "run", timeout_s=30, say=print)
    assert exc.value.name == "registry"
    assert exc.value.exit_code == 3
    assert "exit code 3" in exc.value.reason
    assert any("bad config: NATS_URL 1" in line for line in exc.value.log_tail)


def test_a_process_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    child = launch(python_spec(tmp_path, "router", "import time; time.sleep(60)"))
    try:
        with pytest.raises(StartupError, match=r"not up after 0\.3s"):
            wait_up(child, tmp_path / "run", timeout_s=0.3, say=print)
    finally:
        stop_pid("router", child.popen.pid, 0, 5, print, poll=child.poll)
    assert child.popen.returncode == -signal.SIGTERM


def test_children_run_in_their_own_session(tmp_path: Path) -> None:
    child = launch(python_spec(tmp_path, "x", "import time; time.sleep(60)"))
    try:
        assert os.getsid(child.popen.pid) == child.popen.pid
        assert child.record.start_ticks == process_start_ticks(child.popen.pid)
    finally:
        stop_pid("x", child.popen.pid, child.record.start_ticks, 5, print, poll=child.poll)


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    spec = python_spec(tmp_path, "stubborn", code)
    child = launch(spec)
    # Wait until the handler is installed (it prints after installing it).
    deadline = time.monotonic() + 10
    while "ready" not in spec.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    messages: list[str] = []
    stop_pid("stubborn", child.popen.pid, 0, 0.3, messages.append, poll=child.poll)
    assert child.popen.returncode == -signal.SIGKILL
    assert any("SIGKILL" in m for m in messages)
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(2) == "exit code 2"


def test_stop_by_pid_for_a_detached_process(tmp_path: Path) -> None:
    """`down` has only the pid and start time, not the Popen object."""
    child = launch(python_spec(tmp_path, "y", "import time; time.sleep(60)"))
    pid, ticks = child.popen.pid, child.record.start_ticks
    stop_pid("y", pid, ticks, 5, print)
    assert not is_alive(pid, ticks)
    child.popen.wait()  # reap it (the test process is its parent)


def test_infer_reports_the_grpc_status(capsys: pytest.CaptureFixture) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        rc = main(["infer", "fraud", "--random", "1", "--url", address, "--timeout", "2"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and address in err


def test_infer_needs_inputs(capsys: pytest.CaptureFixture) -> None:
    assert main(["infer", "fraud", "--url", "127.0.0.1:1"]) == 1
    assert "--random" in capsys.readouterr().err


def test_status_and_down_without_a_stack(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["status", "--home", str(tmp_path)]) == 1
    assert "not running" in capsys.readouterr().out
    assert main(["down", "--home", str(tmp_path)]) == 0
    assert "nothing is running" in capsys.readouterr().out
