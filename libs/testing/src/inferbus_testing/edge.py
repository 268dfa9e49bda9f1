"""The compiled gRPC edge (``services/edge``, ``inferbus-edge``) in tests.

`scripts/bootstrap.sh` builds it into the virtual environment's ``bin``. A test
that needs it calls `edge_binary`: without the binary it is skipped with the
command that builds it, except under CI, where a missing edge is a failed setup.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from inferbus_testing.processes import ServiceProcess


def find_edge_binary() -> str | None:
    """The inferbus-edge binary (beside this Python, else on PATH), or None."""
    beside = Path(sys.executable).parent / "inferbus-edge"
    return str(beside) if beside.is_file() else shutil.which("inferbus-edge")


def edge_binary() -> str:
    """The inferbus-edge binary; skips the test when it is missing (fails it under
    CI=true)."""
    found = find_edge_binary()
    if found:
        return found
    reason = "inferbus-edge is not built: run scripts/build-edge.sh --install-deps"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (scripts/bootstrap.sh does under CI)")
    pytest.skip(reason)


def edge_process(
    nats_url: str, upstream: str, log_dir: Path, *, name: str = "edge", **env: str
) -> ServiceProcess:
    """An edge on free ports in front of the gateways of `nats_url` (not started).

    Args:
        nats_url: the stack's NATS.
        upstream: a gateway's gRPC ``HOST:PORT`` for streams and other services
            ("" for none).
        log_dir: where its log and ports file go.
        name: its name (log file, errors).
        env: more ``INFERBUS_EDGE_*`` settings (names without the prefix).
    """
    return ServiceProcess(
        "inferbus_edge",
        name=name,
        command=[find_edge_binary() or edge_binary()],
        env={
            "INFERBUS_EDGE_NATS_URL": nats_url,
            "INFERBUS_EDGE_GRPC_PORT": "0",
            "INFERBUS_EDGE_METRICS_PORT": "0",
            "INFERBUS_EDGE_UPSTREAM": upstream,
            **{f"INFERBUS_EDGE_{k}": v for k, v in env.items()},
        },
        log_dir=log_dir,
    )
