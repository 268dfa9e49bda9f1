"""What a worker runs on: CPUs, memory, GPU type and count, for its heartbeat.

Pools add the workers' specs up (``inferbus pools`` shows total GPUs) and
check GPU quotas against them, so the numbers must be what this process can
actually use, not the host's:

* CPUs: the affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``);
* memory: the cgroup limit (v2 ``memory.max`` or v1 ``limit_in_bytes``) when
  lower than the host's RAM;
* GPUs: `inferbus_common.gpus.process_gpus` (NVML, else ``nvidia-smi``,
  filtered by ``CUDA_VISIBLE_DEVICES``, the CUDA runtime's own contract for
  which devices a process sees), with their UUIDs. No GPU, no driver: 0 and ''.

Detection runs once at start-up (in a thread: nvidia-smi may take a moment).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from inferbus_common.gpus import process_gpus

log = logging.getLogger(__name__)

_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class HostSpec:
    """The resources one worker process can use."""

    cpus: int = 0
    memory_bytes: int = 0
    gpu_type: str = ""
    gpu_count: int = 0
    gpu_uuids: tuple[str, ...] = ()
    """The GPUs' UUIDs: the same GPU seen by two workers counts once in a pool."""


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


def detect() -> HostSpec:
    """The spec of this process (see module docstring); never raises."""
    shown = process_gpus()
    spec = HostSpec(
        cpus=cpu_count(),
        memory_bytes=memory_bytes(),
        gpu_type=",".join(sorted({g.name for g in shown})),
        gpu_count=len(shown),
        gpu_uuids=tuple(g.uuid for g in shown),
    )
    log.info(
        "worker spec: %d cpus, %d MiB, %d x %s",
        spec.cpus,
        spec.memory_bytes >> 20,
        spec.gpu_count,
        spec.gpu_type or "no GPU",
    )
    return spec
