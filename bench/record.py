"""Where benchmark results go and what machine they came from.

Every benchmark script appends one JSON object per run to a ``.jsonl`` file
under ``bench/results/`` (gitignored) and stamps it with `machine_info`, so a
number is never separated from the command and the machine that produced it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1024 * 1024), 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Describe the machine and software a result was measured on.

    Returns:
        CPU model, logical CPUs usable by this process, memory, the 1/5/15 min
        load average at the time of the call (other work on a shared machine
        shows up here), OS, Python and onnxruntime versions, the git commit and
        the CPUs' steal and total jiffies so far.
    """
    try:
        import onnxruntime

        ort_version: str | None = onnxruntime.__version__
    except ImportError:
        ort_version = None
    return {
        "cpu": _cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "mem_gib": _mem_total_gib(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "onnxruntime": ort_version,
        "git": _git_commit(),
        "cpu_jiffies": cpu_jiffies(),
    }


def cpu_jiffies() -> list[int] | None:
    """[steal, total] jiffies of all CPUs so far (/proc/stat): two readings give the
    share of the time a virtual machine's host took its CPUs away (steal)."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return [values[7] if len(values) > 7 else 0, sum(values)]


def append_result(path: Path, record: dict[str, Any]) -> None:
    """Append one result as a JSON line, stamped with the time of writing.

    Args:
        path: the ``.jsonl`` file (parent folders are created).
        record: the result; ``"ts"`` (unix seconds) is added when missing.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    record.setdefault("ts", round(time.time(), 3))
    with path.open("a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
