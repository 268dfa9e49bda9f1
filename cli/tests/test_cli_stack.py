"""The whole stack through the CLI: `up -d`, `models push`, `infer`, `status`, `down`.

Real processes: nats-server (JetStream), redis-server (when installed) and
every inferbus service, all on ports they pick themselves (``--free-ports``),
read back from their ports files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
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


def kill_leftovers(pids: list[tuple[int, int]], home: Path | None = None) -> None:
    """Last-resort cleanup so a failing test never leaves services behind.

    With `home`, the stack's supervisor goes first (it would restart the rest).
    """
    state = load_state(home) if home is not None and (home / "state.json").exists() else None
    if state is not None and state.supervisor_pid and state.supervisor_pid != os.getpid():
        if is_alive(state.supervisor_pid):
            os.kill(state.supervisor_pid, signal.SIGKILL)
        pids = pids + [(p.pid, p.start_ticks) for p in state.processes]
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

        # A state file naming another stack at these very addresses (its own stack
        # gone, this one started on its ports): each command through it is refused
        # by the registry or the gateway, and nothing lands here (`models list` below).
        state = load_state(home)
        assert state is not None and len(state.stack_id) == 12
        other = tmp_path / "other"
        other.mkdir()
        stale = dataclasses.replace(state, stack_id="0123456789ab", home=str(other))
        (other / "state.json").write_text(stale.to_json())
        misled = cli(other, "models", "push", str(model_dir), "--name", "fraud", "--version", "2")
        assert misled.returncode == 1, misled.stdout
        assert "FAILED_PRECONDITION" in misled.stderr, misled.stderr
        assert f"registry belongs to stack {state.stack_id}, not to stack 0123456789ab" in (
            misled.stderr
        )
        rc, out, err = run_main(capsys, other, "models", "wait", "fraud", "--timeout", "5")
        assert rc == 1 and f"gateway belongs to stack {state.stack_id}" in err, out + err
        rc, out, err = run_main(capsys, other, "infer", "fraud", "--random", "1")
        assert rc == 1 and "FAILED_PRECONDITION" in err, err

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
        kill_leftovers(pids, home)


def test_foreground_stack_restarts_a_crashed_service_and_stops_on_down(tmp_path: Path) -> None:
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
        # Started again after the first back-off, on the ports it had.
        wait_for(lambda: "router up again" in out.read_text(), 60, "the router's restart")
        state = load_state(home)
        assert state is not None
        again = next(p for p in state.processes if p.name == "router")
        pids += [(again.pid, again.start_ticks)]
        assert again.pid != router.pid and again.restarts == 1
        assert again.last_exit == "killed by SIGKILL"
        assert again.ports == router.ports

        status = cli(home, "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        row = next(p for p in json.loads(status.stdout)["processes"] if p["name"] == "router")
        assert row["alive"] and row["restarts"] == 1
        table = cli(home, "status").stdout
        assert "RESTARTS" in table and "crashed processes are restarted" in table

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


def test_detached_stack_on_a_nats_cluster_is_supervised(tmp_path: Path) -> None:
    """`up -d --nats-cluster 3`: three nodes, every service given all of them, and a
    background supervisor that restarts a killed worker and a killed NATS node."""
    home = tmp_path / "home"
    up = cli(home, "up", "-d", "--free-ports", "--no-redis", "--nats-cluster", "3")
    pids = recorded_pids(home)
    state = load_state(home)
    supervisor = state.supervisor_pid if state else 0
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "inferbus is up" in up.stdout and "supervised in the background" in up.stdout
        assert state is not None and state.detached
        assert supervisor not in (0, os.getpid()) and is_alive(supervisor)
        names = [p.name for p in state.processes]
        assert names[:3] == ["nats-1", "nats-2", "nats-3"]
        urls = state.endpoints["nats"].split(",")
        assert len(urls) == 3
        worker = next(p for p in state.processes if p.name == "worker-1")
        env = Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
        assert f"INFERBUS_WORKER_NATS_URL={','.join(urls)}".encode() in env
        assert b"INFERBUS_WORKER_JETSTREAM_REPLICAS=3" in env

        os.kill(worker.pid, signal.SIGKILL)
        node = next(p for p in state.processes if p.name == "nats-2")
        os.kill(node.pid, signal.SIGKILL)

        def restarted() -> bool:
            # A service starting while the cluster elects leaders may exit once
            # more and be restarted again: wait until everything runs.
            now = load_state(home)
            rows = {p.name: p for p in now.processes} if now else {}
            return (
                rows["worker-1"].restarts >= 1
                and rows["nats-2"].restarts >= 1
                and all(is_alive(p.pid, p.start_ticks) for p in rows.values())
            )

        wait_for(restarted, 90, "the supervisor to restart worker-1 and nats-2")
        pids = recorded_pids(home)
        status = cli(home, "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        rows = {p["name"]: p for p in json.loads(status.stdout)["processes"]}
        assert rows["nats-2"]["restarts"] == 1 and rows["nats-2"]["alive"]
        assert rows["nats-2"]["last_exit"] == "killed by SIGKILL"
        assert rows["worker-1"]["restarts"] >= 1 and rows["worker-1"]["alive"]
        log = (home / "logs" / "supervisor.log").read_text()
        assert "restarting worker-1" in log and "restarting nats-2" in log

        down = cli(home, "down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "asking the background supervisor" in down.stdout
        wait_for(lambda: not is_alive(supervisor), 30, "the supervisor to exit")
        assert not any(is_alive(pid, ticks) for pid, ticks in pids)
        assert not (home / "state.json").exists()
    finally:
        if supervisor and is_alive(supervisor):
            os.kill(supervisor, signal.SIGKILL)
        kill_leftovers(pids, home)


def test_a_gateway_group_shares_its_ports_and_a_second_stack_is_refused(tmp_path: Path) -> None:
    """`up -d --gateways 2`: two gateway processes on one HTTP and gRPC port, both in
    `status`, one /metrics/group; a killed first gateway rejoins its group; a second
    stack on the taken gRPC port fails with a clear error."""
    home = tmp_path / "home"
    up = cli(home, "up", "-d", "--free-ports", "--no-llm", "--gateways", "2")
    pids = recorded_pids(home)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "/metrics/group (every gateway process" in up.stdout
        status = cli(home, "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        rows = {p["name"]: p for p in json.loads(status.stdout)["processes"]}
        first, second = rows["gateway"], rows["gateway-2"]
        assert first["pid"] != second["pid"]
        assert first["ports"]["grpc"] == second["ports"]["grpc"]
        assert first["ports"]["http"] == second["ports"]["http"]
        assert first["ports"]["metrics"] != second["ports"]["metrics"]
        grpc_port = first["ports"]["grpc"]
        group = f"http://127.0.0.1:{second['ports']['metrics']}/metrics/group"
        text = urllib.request.urlopen(group, timeout=5).read().decode()
        assert 'gateway_process="gateway"' in text and 'gateway_process="gateway-2"' in text

        other = cli(tmp_path / "other", "up", "-d", "--free-ports", "--grpc-port", str(grpc_port))
        assert other.returncode != 0
        assert f"port {grpc_port} (gateway gRPC) is already in use" in other.stderr

        os.kill(first["pid"], signal.SIGKILL)

        def rejoined() -> bool:
            now = load_state(home)
            row = next(p for p in now.processes if p.name == "gateway") if now else None
            return row is not None and row.restarts >= 1 and is_alive(row.pid, row.start_ticks)

        wait_for(rejoined, 60, "the first gateway to be restarted into its group")
        pids = recorded_pids(home)
        again = {
            p["name"]: p for p in json.loads(cli(home, "status", "--json").stdout)["processes"]
        }
        assert again["gateway"]["ports"]["grpc"] == grpc_port
        down = cli(home, "down")
        assert down.returncode == 0, down.stdout + down.stderr
    finally:
        kill_leftovers(pids, home)
        kill_leftovers(recorded_pids(tmp_path / "other"), tmp_path / "other")


def test_up_with_the_edge_serves_through_it_and_restarts_it_on_its_port(tmp_path: Path) -> None:
    """`up -d --gateways 2 --edge`: the edge is a supervised process of the stack,
    named in the endpoints; through it the pushed model answers and the calls of
    one connection reach both gateway processes; killed, it comes back on its port."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from inferbus_testing.edge import edge_binary
    from inferbus_testing.examples import make_fraud_model

    edge_binary()  # skips (or fails under CI) without it
    home = tmp_path / "home"
    up = cli(home, "up", "-d", "--free-ports", "--no-llm", "--gateways", "2", "--edge")
    pids = recorded_pids(home)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "(edge: unary calls over NATS to every gateway)" in up.stdout
        state = load_state(home)
        assert state is not None
        edge_url = state.endpoints["edge_grpc"]
        model = make_fraud_model(tmp_path / "fraud")
        push = cli(home, "models", "push", str(model), "--name", "fraud", "--version", "1.0.0")
        assert push.returncode == 0, push.stdout + push.stderr
        client = grpcclient.InferenceServerClient(edge_url)
        wait_for(lambda: client.is_model_ready("fraud"), 60, "fraud ready through the edge")
        x = np.zeros((1, 64), np.float32)
        inp = grpcclient.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        for _ in range(40):
            assert client.infer("fraud", [inp]).as_numpy("probabilities").shape == (1, 2)
        group = state.endpoints["gateway_metrics"].removesuffix("/metrics") + "/metrics/group"
        text = urllib.request.urlopen(group, timeout=5).read().decode()
        served = {
            line.split('gateway_process="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("inferbus_gateway_requests_total{") and 'model="fraud"' in line
        }
        assert served == {"gateway", "gateway-2"}, served
        client.close()

        row = next(p for p in state.processes if p.name == "edge")
        port = row.ports["grpc"]
        os.kill(row.pid, signal.SIGKILL)

        def restarted() -> bool:
            now = load_state(home)
            again = next(p for p in now.processes if p.name == "edge") if now else None
            return again is not None and again.restarts >= 1 and is_alive(again.pid)

        wait_for(restarted, 60, "the edge to be restarted")
        pids = recorded_pids(home)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        wait_for(lambda: client.is_server_ready(), 30, "the restarted edge to answer")
        assert client.infer("fraud", [inp]).as_numpy("probabilities").shape == (1, 2)
        client.close()
        down = cli(home, "down")
        assert down.returncode == 0, down.stdout + down.stderr
    finally:
        kill_leftovers(pids, home)
