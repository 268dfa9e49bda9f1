"""Workers that can serve ``engine.providers: ["openvino"]`` versions.

ONNX Runtime's OpenVINO execution provider comes in the onnxruntime-openvino
wheel, which replaces the ``onnxruntime`` module, so it lives in
``.venvs/openvino`` (``scripts/bootstrap-openvino.sh``), never in the
workspace's environment. A worker that serves such versions runs with that
interpreter; tests skip, saying why, where it is missing or cannot load the EP::

    reason = openvino_missing()
    if reason: pytest.skip(reason)
    start_openvino_worker(stack, pool="openvino")
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.stack import LocalStack

REPO = Path(__file__).resolve().parents[4]
OPENVINO_PYTHON = REPO / ".venvs" / "openvino" / "bin" / "python"
"""The interpreter of the OpenVINO environment."""


@functools.cache
def openvino_missing() -> str | None:
    """Why an OpenVINO-EP worker cannot run here, or None when it can."""
    if not OPENVINO_PYTHON.exists():
        return ".venvs/openvino is missing: run scripts/bootstrap-openvino.sh"
    probe = subprocess.run(
        [
            str(OPENVINO_PYTHON),
            "-c",
            "import onnxruntime as o; print(o.get_available_providers())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return f".venvs/openvino cannot import onnxruntime: {probe.stderr.strip()[-500:]}"
    if "OpenVINOExecutionProvider" not in probe.stdout:
        return (
            f".venvs/openvino's onnxruntime has no OpenVINOExecutionProvider "
            f"({probe.stdout.strip()}): rerun scripts/bootstrap-openvino.sh"
        )
    return None


def start_openvino_worker(
    stack: LocalStack, name: str = "openvino-worker", pool: str = "openvino"
) -> ServiceProcess:
    """Start a tensor worker with the OpenVINO environment's interpreter in `pool`;
    wait until it is ready."""
    worker = stack.start_worker(
        name, python=str(OPENVINO_PYTHON), env={"INFERBUS_WORKER_POOL": pool}
    )
    worker.wait_ready(timeout=60)
    return worker
