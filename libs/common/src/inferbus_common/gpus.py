"""GPU discovery: which NVIDIA GPUs a host has, and which a process sees.

One answer for the CLI (``inferbus up --gpus`` starts one worker per GPU),
the worker's heartbeat (pools count physical GPUs by UUID) and placement
(an instance goes to the visible GPU with the most free memory).

Sources, in order: NVML (``pynvml``, the ``nvidia-ml-py`` package) when it
imports and finds a driver, else ``nvidia-smi``. Neither: no GPUs. NVML
and nvidia-smi number GPUs in PCI bus order; the CUDA runtime numbers them
fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which is why
``inferbus up`` sets that for the workers it starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from inferbus_common.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU as the driver reports it."""

    index: int
    """Index in PCI bus order (NVML's, nvidia-smi's)."""
    uuid: str
    """``GPU-…``: the same on every process and after a reboot."""
    name: str
    memory_total_bytes: int = 0
    memory_free_bytes: int = 0


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_gpus() -> list[GpuInfo] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unusable: %s", exc)
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(
                GpuInfo(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_total_bytes=int(memory.total),
                    memory_free_bytes=int(memory.free),
                )
            )
        return out
    except pynvml.NVMLError as exc:
        log.debug("NVML failed: %s", exc)
        return None
    finally:
        pynvml.nvmlShutdown()


def parse_smi(text: str) -> list[GpuInfo]:
    """GPUs from ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.free
    --format=csv,noheader,nounits`` (memory in MiB)."""
    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        index, uuid, name, total, free = fields[:5]
        out.append(
            GpuInfo(
                index=int(index),
                uuid=uuid,
                name=name,
                memory_total_bytes=int(total) << 20 if total.isdigit() else 0,
                memory_free_bytes=int(free) << 20 if free.isdigit() else 0,
            )
        )
    return out


def _smi_gpus() -> list[GpuInfo] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run(
            [
                exe,
                "--query-gpu=index,uuid,name,memory.total,memory.free",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi failed: %s", exc)
        return None
    return parse_smi(text)


def host_gpus() -> list[GpuInfo]:
    """Every GPU of the host (NVML, else nvidia-smi; none: empty); never raises."""
    gpus = _nvml_gpus()
    if gpus is None:
        gpus = _smi_gpus() or []
    return gpus


def visible_gpus(gpus: Sequence[GpuInfo], cuda_visible_devices: str | None) -> list[GpuInfo]:
    """The GPUs a process sees, in CUDA's order: ``CUDA_VISIBLE_DEVICES`` applied.

    Entries are indices or UUIDs (``GPU-…``, a unique prefix is enough);
    like the CUDA runtime, the list ends at the first entry that names no GPU.
    Unset: all of them; empty: none.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    out: list[GpuInfo] = []
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if not token:
            break
        if token.isdigit():
            match = [g for g in gpus if g.index == int(token)]
        else:
            match = [g for g in gpus if g.uuid.startswith(token)]
        if len(match) != 1:
            break  # CUDA stops at the first entry naming no (or no single) device
        out.append(match[0])
    return out


def select_gpus(selection: str, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The GPUs ``--gpus`` names: ``all``, or indices/UUIDs separated by commas.

    Raises:
        FailedPrecondition: GPUs were asked for and this machine has none.
        InvalidArgument: the selection names a GPU that is not there, or one twice.
    """
    if not gpus:
        raise FailedPrecondition(
            f"--gpus {selection}: no NVIDIA GPU found on this machine (neither NVML nor "
            "nvidia-smi reports one); start the stack without --gpus to serve on the CPU"
        )
    if selection.strip() == "all":
        return list(gpus)
    chosen: list[GpuInfo] = []
    for token in (t.strip() for t in selection.split(",")):
        if not token:
            raise InvalidArgument(f"--gpus {selection!r}: an empty entry")
        if token.isdigit():
            match = [g for g in gpus if g.index == int(token)]
        else:
            match = [g for g in gpus if g.uuid.startswith(token)]
        if len(match) != 1:
            have = ", ".join(f"{g.index} ({g.uuid})" for g in gpus)
            raise InvalidArgument(f"--gpus: no single GPU {token!r} here; this host has {have}")
        if match[0] in chosen:
            raise InvalidArgument(f"--gpus: GPU {token!r} named twice")
        chosen.append(match[0])
    return chosen


def roomiest(gpus: Sequence[GpuInfo], count: int) -> list[int]:
    """Positions (CUDA ordinals) in `gpus` for `count` instances, most free memory first.

    Instances are spread round-robin over the GPUs sorted by free memory
    (ties: lower ordinal first), so one GPU gets a second instance only when
    every GPU has one. No GPUs: ordinal 0 for all (the provider then fails
    loudly if it cannot start).
    """
    if not gpus:
        return [0] * count
    order = sorted(range(len(gpus)), key=lambda i: (-gpus[i].memory_free_bytes, i))
    return [order[i % len(order)] for i in range(count)]


def process_gpus() -> list[GpuInfo]:
    """The GPUs this process sees (`host_gpus` through ``CUDA_VISIBLE_DEVICES``).

    ``CUDA_VISIBLE_DEVICES`` is read here, where it is used: it is the CUDA
    runtime's contract with the process, not an inferbus setting.
    """
    return visible_gpus(host_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
