"""`lower_priority`: the niceness of the worker, and of its session's autogroup when it leads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferbus_worker.llm import priority
from inferbus_worker.llm.priority import lower_priority


@pytest.fixture
def fake_os(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The process's niceness and session as the module sees them (never the test's own)."""
    state = {"nice": 0, "sid": 100, "pid": 100}

    def setpriority(_which: int, _who: int, value: int) -> None:
        state["nice"] = value

    monkeypatch.setattr(priority.os, "getpriority", lambda _which, _who: state["nice"])
    monkeypatch.setattr(priority.os, "setpriority", setpriority)
    monkeypatch.setattr(priority.os, "getsid", lambda _pid: state["sid"])
    monkeypatch.setattr(priority.os, "getpid", lambda: state["pid"])
    return state


def test_session_leader_lowers_process_and_autogroup(
    fake_os: dict[str, int], tmp_path: Path
) -> None:
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-42 nice 0\n")
    changed = lower_priority(10, group)
    assert fake_os["nice"] == 10
    assert group.read_text() == "10"
    assert changed == ["process nice 10", "session (autogroup) nice 10"]


def test_not_session_leader_leaves_the_group_alone(fake_os: dict[str, int], tmp_path: Path) -> None:
    # The session (a shell's) is not the worker's: only the process is lowered.
    fake_os["pid"] = 101
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-42 nice 0\n")
    assert lower_priority(10, group) == ["process nice 10"]
    assert group.read_text() == "/autogroup-42 nice 0\n"


def test_never_raises_a_priority(fake_os: dict[str, int], tmp_path: Path) -> None:
    fake_os["nice"] = 15
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-42 nice 19\n")
    assert lower_priority(10, group) == []
    assert fake_os["nice"] == 15
    assert group.read_text() == "/autogroup-42 nice 19\n"


def test_zero_changes_nothing_and_no_autogroup_is_fine(
    fake_os: dict[str, int], tmp_path: Path
) -> None:
    assert lower_priority(0, tmp_path / "absent") == []
    assert fake_os["nice"] == 0
    assert lower_priority(5, tmp_path / "absent") == ["process nice 5"]


def test_autogroup_file_format() -> None:
    assert priority._autogroup_nice("/autogroup-7 nice -3\n") == -3
    assert priority._autogroup_nice("garbage") is None
    # Some kernels (CI's among them) expose the file but leave it empty.
    assert priority._autogroup_nice("") is None


def test_an_empty_autogroup_file_is_left_alone(fake_os: dict[str, int], tmp_path: Path) -> None:
    group = tmp_path / "autogroup"
    group.write_text("")
    assert lower_priority(10, group) == ["process nice 10"]
    assert group.read_text() == ""
