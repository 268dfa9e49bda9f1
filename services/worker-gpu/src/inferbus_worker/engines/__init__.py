"""Engines: the `Engine` contract and its backends (ONNX Runtime, TensorRT)."""

from __future__ import annotations

from pathlib import Path

from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines.base import (
    Engine,
    EngineError,
    EngineInputError,
    PermanentEngineError,
    warmup_batch_sizes,
)
from inferbus_worker.engines.onnx import OnnxRuntimeEngine, choose_providers
from inferbus_worker.engines.tensorrt import TensorRTEngine

__all__ = [
    "Engine",
    "EngineError",
    "EngineInputError",
    "OnnxRuntimeEngine",
    "PermanentEngineError",
    "TensorRTEngine",
    "build_engine",
    "choose_providers",
    "warmup_batch_sizes",
]


def build_engine(config: ModelConfig, model_dir: Path, *, trt_cache_dir: Path) -> Engine:
    """The engine `config` asks for, on the artifact in `model_dir` (not loaded yet).

    Args:
        config: the version's config (engine kind, providers, instance count).
        model_dir: directory holding the version's files.
        trt_cache_dir: cache of engines built by the TensorRT execution provider.
    """
    path = model_dir / config.file
    if config.engine.kind == "tensorrt":
        return TensorRTEngine(path, instance_count=config.instance_count)
    return OnnxRuntimeEngine(path, config.engine, trt_cache_dir=trt_cache_dir)
