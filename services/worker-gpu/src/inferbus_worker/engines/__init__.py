"""Engines: the `Engine` contract and its backends (ONNX Runtime, TensorRT, PyTorch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from inferbus_common.gpus import GpuInfo, process_gpus, roomiest
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines.base import (
    Engine,
    EngineError,
    EngineInputError,
    PermanentEngineError,
    ProviderUnavailable,
    warmup_batch_sizes,
)
from inferbus_worker.engines.instances import EngineInstances
from inferbus_worker.engines.onnx import OnnxRuntimeEngine, choose_providers
from inferbus_worker.engines.pytorch import TorchEngine, TorchUnavailable
from inferbus_worker.engines.tensorrt import TensorRTEngine

__all__ = [
    "Engine",
    "EngineError",
    "EngineInputError",
    "EngineInstances",
    "OnnxRuntimeEngine",
    "PermanentEngineError",
    "ProviderUnavailable",
    "TensorRTEngine",
    "TorchEngine",
    "TorchUnavailable",
    "build_engine",
    "choose_providers",
    "place_instances",
    "warmup_batch_sizes",
]


def build_engine(
    config: ModelConfig,
    model_dir: Path,
    *,
    trt_cache_dir: Path,
    gpus: Callable[[], Sequence[GpuInfo]] = process_gpus,
    label: str = "",
) -> Engine:
    """The engine `config` asks for, on the artifact in `model_dir` (not loaded yet).

    Without an ``instance_group``: one engine (one session shared by
    ``instance_count`` threads). With one: `EngineInstances`, one engine per
    instance, each placed on its GPU (`place_instances`).

    Args:
        config: the version's config (engine kind, providers, options, instances).
        model_dir: directory holding the version's files.
        trt_cache_dir: cache of engines built by the TensorRT execution provider.
        gpus: the GPUs this process sees (read only when a GPU instance needs placing).
        label: the version in words (``fraud version 3``), for the engines' errors.
    """
    path = model_dir / config.file
    engine = config.engine
    group = config.instance_group
    if engine.kind == "tensorrt":
        trt_device = engine.tensorrt.device_id if engine.tensorrt is not None else 0
        if group is None or len(group.gpus) <= 1:
            device = group.gpus[0] if group is not None and group.gpus else trt_device
            return TensorRTEngine(path, instance_count=config.instance_count, device=device)
        return EngineInstances(
            [TensorRTEngine(path, instance_count=group.count, device=g) for g in group.gpus],
            runs_each=group.count,
        )
    if engine.kind == "pytorch":
        # torch is imported when an instance loads (a worker without it refuses then).
        if group is None:
            (ordinal,) = place_instances(config, gpus)
            return TorchEngine(path, config, device_id=ordinal, label=label)
        cpu_only = group.kind == "KIND_CPU"
        devices = place_instances(config, gpus) if not cpu_only else [None] * group.instances
        return EngineInstances(
            [
                TorchEngine(path, config, device_id=d, cpu_only=cpu_only, label=label)
                for d in devices
            ]
        )
    batched = config.max_batch_size > 0
    sizes = warmup_batch_sizes(config)
    if group is None:
        (ordinal,) = place_instances(config, gpus)
        return OnnxRuntimeEngine(
            path,
            engine,
            trt_cache_dir=trt_cache_dir,
            device_id=ordinal,
            batched=batched,
            batch_sizes=sizes,
        )
    cpu_only = group.kind == "KIND_CPU"
    devices = place_instances(config, gpus) if not cpu_only else [None] * group.instances
    return EngineInstances(
        [
            OnnxRuntimeEngine(
                path,
                engine,
                trt_cache_dir=trt_cache_dir,
                device_id=ordinal,
                cpu_only=cpu_only,
                batched=batched,
                batch_sizes=sizes,
            )
            for ordinal in devices
        ]
    )


def place_instances(
    config: ModelConfig, gpus: Callable[[], Sequence[GpuInfo]] = process_gpus
) -> list[int | None]:
    """The CUDA ordinal of each instance of `config`'s group (None: the options' device_id).

    ``instance_group.gpus`` places ``count`` instances on each GPU named; a
    GPU engine whose options do not pin a ``device_id`` is spread over the
    visible GPUs with the most free memory; a CPU engine needs no GPU.
    """
    group = config.instance_group
    count = group.instances if group is not None else 1
    if group is not None and group.gpus:
        return [g for g in group.gpus for _ in range(group.count)]
    engine = config.engine
    if engine.device_kind != "gpu":
        return [None] * count
    options = engine.tensorrt if engine.providers[0] == "tensorrt" else engine.cuda
    # A pytorch engine's placement needs no torch: NVML / nvidia-smi, as for ONNX Runtime.
    if options is not None and "device_id" in options.model_fields_set:
        return [None] * count
    return list(roomiest(gpus(), count))
