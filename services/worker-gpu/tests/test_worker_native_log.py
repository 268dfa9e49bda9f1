"""Native libraries' stderr lines come out of the worker as JSON log records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferbus_worker.engines.nativelog import native_level

_CHILD = r"""
import logging, os, sys
from inferbus_common.logs import setup_logging
from inferbus_worker.engines.nativelog import relay_native_logs

setup_logging("worker", "INFO", "json")
relay = relay_native_logs()
mark = relay.mark()
logging.getLogger("inferbus_worker.test").info("own record")
# What ONNX Runtime's C++ logger writes on fd 2: coloured, not JSON.
os.write(2, b"\x1b[1;31m2026-12-04 10:00:00.1 [E:onnxruntime:Default, cuda_call.cc:118] "
            b"CUDA failure 100: no CUDA-capable device is detected\x1b[m\n")
os.write(2, b"[TRT] [W] a TensorRT warning\n")
if len(sys.argv) > 1:
    # A real session on a model file: whatever ONNX Runtime says goes through too.
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 0
    ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
seen = relay.lines_since(mark)
relay.stop()
print(repr(seen))
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_native_lines_become_json_records() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    docs = [json.loads(line) for line in lines]  # every line is JSON
    by_message = {d["msg"]: d for d in docs}
    own = by_message["own record"]
    assert own["logger"] == "inferbus_worker.test"
    cuda = next(d for d in docs if "CUDA failure 100" in d["msg"])
    assert cuda["level"] == "ERROR" and cuda["logger"] == "inferbus_worker.native"
    assert "\x1b" not in cuda["msg"]
    trt = next(d for d in docs if "a TensorRT warning" in d["msg"])
    assert trt["level"] == "WARNING"
    # The lines are kept for a failed load to quote.
    assert "CUDA failure 100" in proc.stdout and "own record" not in proc.stdout


def test_onnxruntime_session_lines_are_json(fraud_dir: Path) -> None:
    proc = _run(str(fraud_dir / "model.onnx"))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines
    for line in lines:
        json.loads(line)


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("2026 [W:onnxruntime:, session_state.cc:1280] Some nodes were not assigned", "WARNING"),
        ("2026 [I:onnxruntime:, inference_session.cc:1] Initializing session", "INFO"),
        ("2026 [E:onnxruntime:Default, provider_bridge.cc:2] Failed to load library", "ERROR"),
        ("[TRT] [E] 1: [defaultAllocator.cpp::allocate::31] Error Code 1", "ERROR"),
        ("something else entirely", "WARNING"),
    ],
)
def test_native_levels(line: str, level: str) -> None:
    import logging

    assert logging.getLevelName(native_level(line)) == level


def test_last_words_before_exit_are_not_lost() -> None:
    child = (
        "from inferbus_common.logs import setup_logging\n"
        "from inferbus_worker.engines.nativelog import relay_native_logs\n"
        "setup_logging('worker', 'INFO', 'json')\n"
        "relay_native_logs()\n"
        "raise SystemExit('bye: the last line')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 1
    assert any("bye: the last line" in line for line in proc.stderr.splitlines()), proc.stderr
