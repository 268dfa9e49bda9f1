"""GPU utilisation and memory on /metrics, read from NVML at scrape time.

Only when NVML is there: the ``nvidia-ml-py`` package (module ``pynvml``,
in the worker's ``gpu`` extra) must import and ``nvmlInit`` must find a
driver. Otherwise nothing is registered and the worker serves as before (a
CPU-only worker exports no GPU series). Reading at scrape time costs the
request path nothing.

Only the GPUs the worker sees (``CUDA_VISIBLE_DEVICES``, as
`inferbus_common.gpus` applies it) are exported, labelled with NVML's index
and the GPU's UUID: with one worker per GPU each worker reports its own GPU,
and series of workers that share a GPU can be told apart from series of
different GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inferbus_common.gpus import process_gpus

log = logging.getLogger(__name__)


class NvmlCollector(Collector):
    """Prometheus collector of every visible GPU's utilisation and memory.

    Args:
        nvml: the imported, initialised ``pynvml`` module.
        visible: UUIDs of the GPUs this process sees (None: every GPU NVML reports).
    """

    def __init__(self, nvml: Any, visible: set[str] | None = None) -> None:
        self._nvml = nvml
        self._gpus: list[tuple[int, str]] = []
        for i in range(nvml.nvmlDeviceGetCount()):
            uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            if visible is None or uuid in visible:
                self._gpus.append((i, uuid))

    @property
    def gpus(self) -> int:
        """GPUs exported (those visible to the process at start-up)."""
        return len(self._gpus)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per GPU and metric; a GPU that fails to answer is skipped."""
        nvml = self._nvml
        util = GaugeMetricFamily(
            "inferbus_worker_gpu_utilization_ratio",
            "Share of the last sample period in which a kernel ran on the GPU (NVML), 0..1.",
            labels=["gpu", "uuid"],
        )
        used = GaugeMetricFamily(
            "inferbus_worker_gpu_memory_used_bytes",
            "GPU memory in use, all processes (NVML).",
            labels=["gpu", "uuid"],
        )
        total = GaugeMetricFamily(
            "inferbus_worker_gpu_memory_total_bytes",
            "GPU memory installed (NVML).",
            labels=["gpu", "uuid"],
        )
        for i, uuid in self._gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as exc:
                log.debug("NVML could not read GPU %d: %s", i, exc)
                continue
            util.add_metric([str(i), uuid], rates.gpu / 100.0)
            used.add_metric([str(i), uuid], float(memory.used))
            total.add_metric([str(i), uuid], float(memory.total))
        yield util
        yield used
        yield total


def register_nvml_collector(registry: Any = REGISTRY) -> bool:
    """Export GPU metrics when NVML is usable; False (and nothing registered) otherwise."""
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
        collector = NvmlCollector(pynvml, {g.uuid for g in process_gpus()})
    except pynvml.NVMLError as exc:
        log.info("no GPU metrics: NVML is not usable (%s)", exc)
        return False
    registry.register(collector)
    log.info("GPU metrics from NVML for %d GPU(s)", collector.gpus)
    return True
