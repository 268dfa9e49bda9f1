"""Engines on the example fraud model, against ONNX Runtime called directly."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferbus_common.modelconfig import EngineConfig, ModelConfig
from inferbus_worker.engines import (
    Engine,
    EngineError,
    EngineInputError,
    OnnxRuntimeEngine,
    ProviderUnavailable,
    TensorRTEngine,
    build_engine,
    choose_providers,
    warmup_batch_sizes,
)


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and Path("/dev/nvidia0").exists()


@pytest.fixture
def engine(fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path):
    eng = build_engine(fraud_config, fraud_dir, trt_cache_dir=tmp_path / "trt")
    eng.load()
    eng.warmup(warmup_batch_sizes(fraud_config))
    yield eng
    eng.close()


@pytest.mark.parametrize("batch", [1, 8])
def test_engine_matches_onnxruntime(engine: Engine, fraud_dir: Path, batch: int) -> None:
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, 64)).astype(np.float32)
    # Read-only zero-copy view, as the worker hands the engine.
    view = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(batch, 64)
    got = engine.run({"input": view}, ["probabilities"])
    session = ort.InferenceSession(
        str(fraud_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (want,) = session.run(["probabilities"], {"input": x})
    assert got["probabilities"].shape == (batch, 2)
    np.testing.assert_allclose(got["probabilities"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["probabilities"].sum(axis=1), 1.0, rtol=1e-5)


def test_engine_is_an_engine(engine: Engine) -> None:
    assert isinstance(engine, Engine)
    assert isinstance(engine, OnnxRuntimeEngine)
    assert engine.description == "onnxruntime[CPUExecutionProvider]"


def test_engine_rejects_bad_inputs(engine: Engine) -> None:
    with pytest.raises(EngineInputError):
        engine.run({"input": np.zeros((2, 3), np.float32)}, ["probabilities"])
    with pytest.raises(EngineInputError):
        engine.run({"input": np.zeros((2, 64), np.float64)}, ["probabilities"])


def test_engine_load_fails_on_a_broken_file(tmp_path: Path, fraud_config: ModelConfig) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not an onnx model")
    eng = build_engine(fraud_config, tmp_path, trt_cache_dir=tmp_path / "trt")
    with pytest.raises(EngineError, match="cannot load"):
        eng.load()


def test_providers_are_wanted_and_available(tmp_path: Path) -> None:
    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    chosen = choose_providers(["tensorrt", "cuda", "cpu"], available, trt_cache_dir=tmp_path)
    assert [p if isinstance(p, str) else p[0] for p in chosen] == available
    _, trt_opts = chosen[0]
    assert trt_opts["trt_engine_cache_enable"] == "1"
    assert trt_opts["trt_engine_cache_path"] == str(tmp_path)
    assert trt_opts["trt_fp16_enable"] == "0"
    _, cuda_opts = chosen[1]
    assert cuda_opts["device_id"] == "0"
    assert choose_providers(["cuda", "cpu"], ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    # onnxruntime-openvino's EP computes on the CPU, named explicitly.
    ov = ["OpenVINOExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(["openvino"], ov) == [
        ("OpenVINOExecutionProvider", {"device_type": "CPU"})
    ]
    # A GPU-only version on a build without its provider: refused, permanently.
    with pytest.raises(ProviderUnavailable, match="none of the execution providers"):
        choose_providers(["cuda"], ["CPUExecutionProvider"])


def test_threads_come_from_config(fraud_dir: Path) -> None:
    eng = OnnxRuntimeEngine(
        fraud_dir / "model.onnx", EngineConfig(intra_op_threads=2, inter_op_threads=2)
    )
    eng.load()
    out = eng.run({"input": np.zeros((3, 64), np.float32)}, ["probabilities"])
    assert out["probabilities"].shape == (3, 2)
    eng.close()
    with pytest.raises(EngineError, match="not loaded"):
        eng.run({"input": np.zeros((3, 64), np.float32)}, ["probabilities"])


def test_warmup_batch_sizes(fraud_config: ModelConfig) -> None:
    assert warmup_batch_sizes(fraud_config) == [1, 32]
    cfg = fraud_config.model_copy(
        update={
            "batching": fraud_config.batching.model_copy(
                update={"preferred_batch_sizes": [4, 8, 64]}
            )
        }
    )
    assert warmup_batch_sizes(cfg) == [1, 4, 8, 32]


def test_tensorrt_engine_without_package_fails_clearly(tmp_path: Path) -> None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        eng = TensorRTEngine(tmp_path / "model.plan")
        with pytest.raises(EngineError, match="tensorrt package is not installed"):
            eng.load()
    else:
        pytest.skip("tensorrt is installed here; covered by the GPU test")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_nvidia_gpu(), reason="TensorRT needs an NVIDIA GPU")
def test_tensorrt_engine_matches_onnxruntime(fraud_dir: Path, tmp_path: Path) -> None:
    trt = pytest.importorskip("tensorrt", reason="TensorRT needs the gpu extra")
    # Build a plan for this GPU from the ONNX model, with a dynamic batch profile.
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse((fraud_dir / "model.onnx").read_bytes())
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("input", (1, 64), (8, 64), (32, 64))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    (tmp_path / "model.plan").write_bytes(bytes(plan))
    eng = TensorRTEngine(tmp_path / "model.plan", instance_count=2)
    eng.load()
    eng.warmup([1, 8, 32])
    x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    got = eng.run({"input": x}, ["probabilities"])["probabilities"]
    session = ort.InferenceSession(
        str(fraud_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (want,) = session.run(["probabilities"], {"input": x})
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    eng.close()
