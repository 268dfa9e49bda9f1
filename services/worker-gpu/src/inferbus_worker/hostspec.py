"""What a worker runs on: CPUs, memory, GPU type and count, for its heartbeat.

Pools add the workers' specs up (``inferbus pools`` shows total GPUs) and
check GPU quotas against them, so the numbers must be what this process can
actually use, not the host's:

* CPUs: the affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``);
* memory: the cgroup limit (v2 ``memory.max`` or v1 ``limit_in_bytes``) when
  lower than the host's RAM;
* GPUs: NVML (``pynvml``) when it imports and finds a driver, else
  ``nvidia-smi``; both filtered by ``CUDA_VISIBLE_DEVICES``, the CUDA
  runtime's own contract for which devices a process sees. No GPU, no
  driver: 0 and ''.

Detection runs once at start-up (in a thread: nvidia-smi may take a moment).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class HostSpec:
    """The resources one worker process can use."""

    cpus: int = 0
    memory_bytes: int = 0
    gpu_type: str = ""
    gpu_count: int = 0


def cpu_count(cgroup: Path = _CGROUP) -> int:
    """CPUs this process may run on (affinity, capped by a cgroup v2 quota)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    with contextlib.suppress(OSError, ValueError):
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return cpus


def memory_bytes(cgroup: Path = _CGROUP) -> int:
    """Memory this process may use: the cgroup limit when lower than the host's RAM."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host = 0
    for limit_file in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = limit_file.read_text().strip()
            if text != "max":
                limit = int(text)
                if 0 < limit < (host or limit + 1):
                    return limit
    return host


def visible(indices: int, cuda_visible_devices: str | None) -> list[int]:
    """Which of `indices` GPUs the CUDA runtime would show (``CUDA_VISIBLE_DEVICES``)."""
    if cuda_visible_devices is None:
        return list(range(indices))
    out: list[int] = []
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if not token:
            continue
        if not token.isdigit():
            # UUIDs or MIG names: count them, the order does not matter here.
            out.append(len(out))
            continue
        if int(token) >= indices:
            break  # CUDA stops at the first invalid index
        out.append(int(token))
    return out


def _nvml_gpus() -> list[str] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            names = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                names.append(name.decode() if isinstance(name, bytes) else str(name))
            return names
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        log.debug("NVML unusable: %s", exc)
        return None


def _smi_gpus() -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi failed: %s", exc)
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def detect() -> HostSpec:
    """The spec of this process (see module docstring); never raises."""
    names = _nvml_gpus()
    if names is None:
        names = _smi_gpus() or []
    shown = [names[i] for i in visible(len(names), os.environ.get("CUDA_VISIBLE_DEVICES"))]
    types = sorted(set(shown))
    spec = HostSpec(
        cpus=cpu_count(),
        memory_bytes=memory_bytes(),
        gpu_type=",".join(types),
        gpu_count=len(shown),
    )
    log.info(
        "worker spec: %d cpus, %d MiB, %d x %s",
        spec.cpus,
        spec.memory_bytes >> 20,
        spec.gpu_count,
        spec.gpu_type or "no GPU",
    )
    return spec
