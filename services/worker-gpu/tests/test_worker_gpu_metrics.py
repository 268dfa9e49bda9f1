"""GPU metrics from NVML: exported on GPU machines, cleanly absent elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
from prometheus_client import CollectorRegistry

from inferbus_worker.gpu import register_nvml_collector

UTILIZATION = "inferbus_worker_gpu_utilization_ratio"
MEMORY_USED = "inferbus_worker_gpu_memory_used_bytes"
MEMORY_TOTAL = "inferbus_worker_gpu_memory_total_bytes"


def _nvml_usable() -> bool:
    if importlib.util.find_spec("pynvml") is None:
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    return True


def test_without_nvml_nothing_is_registered() -> None:
    if _nvml_usable():
        pytest.skip("NVML works on this machine; covered by the gpu test")
    registry = CollectorRegistry()
    assert register_nvml_collector(registry) is False
    assert list(registry.collect()) == []


@pytest.mark.gpu
def test_every_gpu_reports_utilisation_and_memory() -> None:
    if not _nvml_usable():
        pytest.skip("a GPU is present but pynvml (nvidia-ml-py, the worker's gpu extra) is not")
    registry = CollectorRegistry()
    assert register_nvml_collector(registry) is True
    samples = {
        (s.name, s.labels["gpu"]): s.value for fam in registry.collect() for s in fam.samples
    }
    gpus = {gpu for _, gpu in samples}
    assert gpus, "NVML reported no GPU"
    for gpu in gpus:
        assert 0.0 <= samples[(UTILIZATION, gpu)] <= 1.0
        assert 0 < samples[(MEMORY_USED, gpu)] <= samples[(MEMORY_TOTAL, gpu)]


class _NvmlGpus:
    """NVML's answers for two GPUs (the collector's filtering is what is tested)."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle}".encode()

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> object:
        return type("Rates", (), {"gpu": 50})()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        return type("Memory", (), {"used": 1 << 30, "total": 8 << 30})()


def test_only_the_gpus_the_worker_sees_are_exported() -> None:
    from inferbus_worker.gpu import NvmlCollector

    collector = NvmlCollector(_NvmlGpus(), {"GPU-1"})
    assert collector.gpus == 1
    labels = {tuple(sorted(s.labels.items())) for fam in collector.collect() for s in fam.samples}
    assert labels == {(("gpu", "1"), ("uuid", "GPU-1"))}
    assert NvmlCollector(_NvmlGpus()).gpus == 2
