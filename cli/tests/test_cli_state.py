"""state.json round trip, process identity and the home directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferbus_cli.state import (
    ProcessRecord,
    StackState,
    default_gateway_address,
    default_registry_address,
    is_alive,
    last_log_lines,
    load_state,
    process_start_ticks,
    remove_state,
    resolve_home,
    save_state,
    state_path,
)


def sample_state(home: Path) -> StackState:
    return StackState(
        home=str(home),
        started_unix=1_700_000_000.5,
        detached=True,
        processes=[
            ProcessRecord("nats", 10, 123, ["nats-server"], "/l/nats.log", {"client": 4222}),
            ProcessRecord("gateway", 11, 456, ["py"], "/l/gw.log", {"grpc": 8001}, exit_code=3),
        ],
        endpoints={"registry": "127.0.0.1:18070", "gateway_grpc": "127.0.0.1:18001"},
    )


def test_round_trip(tmp_path: Path) -> None:
    state = sample_state(tmp_path)
    path = save_state(tmp_path, state)
    assert path == state_path(tmp_path)
    assert load_state(tmp_path) == state
    remove_state(tmp_path)
    assert load_state(tmp_path) is None
    remove_state(tmp_path)  # idempotent


def test_unreadable_state_is_an_error(tmp_path: Path) -> None:
    state_path(tmp_path).write_text('{"version": 99}')
    with pytest.raises(ValueError, match="not an inferbus state file"):
        load_state(tmp_path)
    state_path(tmp_path).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load_state(tmp_path)


def test_default_addresses_come_from_the_state(tmp_path: Path) -> None:
    assert default_registry_address(tmp_path) == "127.0.0.1:8070"
    assert default_gateway_address(tmp_path) == "127.0.0.1:8001"
    save_state(tmp_path, sample_state(tmp_path))
    assert default_registry_address(tmp_path) == "127.0.0.1:18070"
    assert default_gateway_address(tmp_path) == "127.0.0.1:18001"


def test_resolve_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERBUS_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_home(None) == tmp_path / ".inferbus"
    monkeypatch.setenv("INFERBUS_HOME", str(tmp_path / "env-home"))
    assert resolve_home(None) == tmp_path / "env-home"
    assert resolve_home(str(tmp_path / "given")) == tmp_path / "given"


def test_is_alive_checks_identity_and_zombies() -> None:
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert is_alive(me)
    assert is_alive(me, ticks)
    if ticks:
        assert not is_alive(me, ticks + 1)  # a reused pid is not our process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Exited but not reaped (no wait yet): a zombie counts as dead.
        deadline = time.monotonic() + 10
        while is_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_alive(child.pid)
        assert child.returncode is None  # still unreaped: it was seen as a zombie
    finally:
        child.wait()
    assert not is_alive(0)


def test_last_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert last_log_lines(log) == []
    log.write_text("".join(f"line {i}\n" for i in range(50)) + "\n\n")
    assert last_log_lines(log, 3) == ["line 47", "line 48", "line 49"]


def test_expected_stack_is_the_state_files_for_its_own_endpoints_or_the_environments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inferbus_cli.state import STACK_ID_ENV, StackState, expected_stack, save_state

    monkeypatch.delenv(STACK_ID_ENV, raising=False)
    assert expected_stack(tmp_path, "127.0.0.1:8070") == ""
    save_state(
        tmp_path,
        StackState(
            home=str(tmp_path),
            started_unix=1.0,
            detached=True,
            endpoints={"registry": "127.0.0.1:8070", "gateway_grpc": "127.0.0.1:8001"},
            stack_id="abc123",
        ),
    )
    assert expected_stack(tmp_path, "127.0.0.1:8070") == "abc123"
    assert expected_stack(tmp_path, "127.0.0.1:8001") == "abc123"
    assert expected_stack(tmp_path, "127.0.0.1:9999") == "", "another address: no check"
    monkeypatch.setenv(STACK_ID_ENV, "blue")
    assert expected_stack(tmp_path, "127.0.0.1:9999") == "blue"
