"""The LLM worker's engine settings per device (pure: no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.llm.engine import detect_device, engine_environment, engine_options


def _config(**generation: object) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "tiny",
            "platform": "vllm",
            "file": "hf/config.json",
            "max_batch_size": 0,
            "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
            "engine": {"kind": "vllm"},
            "generation": generation,
        }
    )


def test_cpu_runs_eager_with_a_kv_cache_size_and_no_gpu_share() -> None:
    cfg = _config(max_num_seqs=3, max_model_len=512, dtype="float32", kv_cache_space_gib=2)
    opts = engine_options(cfg, Path("/m"), "cpu")
    assert opts["model"] == "/m" and opts["tokenizer"] == "/m"
    assert (opts["max_num_seqs"], opts["max_model_len"], opts["dtype"]) == (3, 512, "float32")
    assert opts["enforce_eager"] is True
    assert "gpu_memory_utilization" not in opts
    env = engine_environment(cfg, "cpu")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_gpu_uses_graphs_and_the_configured_memory_share() -> None:
    cfg = _config(gpu_memory_utilization=0.5)
    opts = engine_options(cfg, Path("/m"), "cuda")
    assert opts["enforce_eager"] is False
    assert opts["gpu_memory_utilization"] == 0.5
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_environment(cfg, "cuda")
    forced = engine_options(_config(enforce_eager=True), Path("/m"), "cuda")
    assert forced["enforce_eager"] is True


def test_an_explicit_device_is_kept() -> None:
    assert detect_device("cpu") == "cpu"
    assert detect_device("cuda") == "cuda"
    assert _config().generation is not None
    assert _config().generative
