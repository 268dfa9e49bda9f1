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
