"""The edge's Go unit tests (``services/edge/edge_test.go``), run with Debian's Go
toolchain as `scripts/build-edge.sh` builds the edge: its codec, its bus-error
statuses, its /metrics text, its ports file and settings. Without Go the test is
skipped with the command that installs it, except under CI, where a missing Go
is a failed setup (`scripts/bootstrap.sh` installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_edges_go_unit_tests_pass() -> None:
    if shutil.which("go") is None:
        reason = "no Go toolchain: run scripts/build-edge.sh --install-deps"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason} (scripts/bootstrap.sh does under CI)")
        pytest.skip(reason)
    done = subprocess.run(
        ["bash", "scripts/build-edge.sh", "--test", "-v"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    passed = [line for line in out.splitlines() if line.startswith("--- PASS: Test")]
    assert len(passed) >= 5 and "--- FAIL" not in out, out
