"""`inferbus up` runs its tensor workers with the PyTorch environment when it exists."""

from __future__ import annotations

import sys
from pathlib import Path

from inferbus_cli.plan import Ports, UpOptions, service_spec
from inferbus_cli.torchenv import find_torch_python

ENDPOINTS = {"nats": "nats://x:1", "registry": "r:2"}


def test_workers_use_the_torch_interpreter_and_the_rest_the_clis(tmp_path: Path) -> None:
    python = tmp_path / "python"
    options = UpOptions(home=tmp_path, ports=Ports(), workers=2, worker_python=python)
    for name in ("worker-1", "worker-2"):
        assert service_spec(options, name, ENDPOINTS).argv == [str(python), "-m", "inferbus_worker"]
    assert service_spec(options, "router", ENDPOINTS).argv[0] == sys.executable
    plain = UpOptions(home=tmp_path, ports=Ports())
    assert service_spec(plain, "worker-1", ENDPOINTS).argv[0] == sys.executable


def test_find_torch_python_honours_the_environment(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    assert find_torch_python({"INFERBUS_TORCH_PYTHON": str(python)}) == python
    assert find_torch_python({"INFERBUS_TORCH_PYTHON": "off"}) is None
    assert find_torch_python({"INFERBUS_TORCH_PYTHON": str(tmp_path / "missing")}) is None
