"""The ONNX Runtime engine on a real GPU (CUDA provider), against ONNX Runtime on the CPU.

Marked ``gpu``: skipped, with the reason, where this onnxruntime has no CUDA
provider or no NVIDIA GPU is visible. On a GPU host (``/work/shared/gpu``'s kit
installs onnxruntime-gpu) they check what the CPU cannot: the session is on
CUDA, answers match the CPU (within 1e-5 with ``use_tf32: false``), IO
binding and CUDA graphs give the same answers as plain runs, instances get
their own sessions, and a ``cuda``-only version refuses to load rather than
compute on the CPU when no GPU is visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferbus_common.gpus import process_gpus
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines import (
    Engine,
    EngineInputError,
    EngineInstances,
    build_engine,
    warmup_batch_sizes,
)
from inferbus_worker.execution import runs_on_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="this onnxruntime has no CUDA execution provider (install onnxruntime-gpu)",
    ),
    pytest.mark.skipif(not process_gpus(), reason="no NVIDIA GPU visible (NVML / nvidia-smi)"),
]


def _on_cuda(config: ModelConfig, **engine: object) -> ModelConfig:
    doc = config.model_dump()
    doc["engine"] = {**doc["engine"], "providers": ["cuda"], **engine}
    return ModelConfig.model_validate(doc)


def _loaded(config: ModelConfig, model_dir: Path, tmp_path: Path) -> Engine:
    eng = build_engine(config, model_dir, trt_cache_dir=tmp_path / "trt")
    eng.load()
    eng.warmup(warmup_batch_sizes(config))
    return eng


def _cpu_answer(fraud_dir: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(fraud_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(["probabilities"], {"input": x})[0]


def _rows(batch: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(batch, 64)).astype(np.float32)
    # A read-only zero-copy view, as the worker hands the engine.
    return np.frombuffer(x.tobytes(), dtype=np.float32).reshape(batch, 64)


@pytest.fixture
def cuda_engine(fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path):
    eng = _loaded(_on_cuda(fraud_config), fraud_dir, tmp_path)
    yield eng
    eng.close()


def test_session_is_on_cuda_with_io_binding(cuda_engine: Engine) -> None:
    assert cuda_engine.providers[0] == "CUDAExecutionProvider"  # type: ignore[attr-defined]
    assert cuda_engine.device_kind == "gpu" and runs_on_gpu(cuda_engine)
    assert "on cuda:" in cuda_engine.description
    assert cuda_engine.description.endswith("io-binding")


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_answers_match_the_cpu(cuda_engine: Engine, fraud_dir: Path, batch: int) -> None:
    x = _rows(batch, batch)
    got = cuda_engine.run({"input": x}, ["probabilities"])["probabilities"]
    # TF32 on (ONNX Runtime's default): about 1e-3 relative.
    np.testing.assert_allclose(got, _cpu_answer(fraud_dir, x), rtol=1e-3, atol=1e-3)


def test_without_tf32_answers_match_the_cpu_within_1e_5(
    fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path
) -> None:
    eng = _loaded(_on_cuda(fraud_config, cuda={"use_tf32": False}), fraud_dir, tmp_path)
    try:
        x = _rows(32, 5)
        got = eng.run({"input": x}, ["probabilities"])["probabilities"]
        np.testing.assert_allclose(got, _cpu_answer(fraud_dir, x), rtol=1e-5, atol=1e-5)
    finally:
        eng.close()


@pytest.mark.parametrize(
    "cuda",
    [
        {"use_tf32": False, "io_binding": False},
        {"use_tf32": False, "enable_cuda_graph": True},
    ],
    ids=["plain-runs", "cuda-graphs"],
)
def test_io_binding_and_graphs_give_the_same_answers(
    fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path, cuda: dict[str, bool]
) -> None:
    bound = _loaded(_on_cuda(fraud_config, cuda={"use_tf32": False}), fraud_dir, tmp_path)
    other = _loaded(_on_cuda(fraud_config, cuda=cuda), fraud_dir, tmp_path)
    try:
        if cuda.get("enable_cuda_graph"):
            assert other.description.endswith("io-binding+cuda-graphs")
        else:
            assert "io-binding" not in other.description
        # Sizes between the captured ones are padded up and cut back.
        for batch in (1, 3, 32, 5, 1):
            x = _rows(batch, batch)
            want = bound.run({"input": x}, ["probabilities"])["probabilities"]
            got = other.run({"input": x}, ["probabilities"])["probabilities"]
            assert got.shape == (batch, 2)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        bound.close()
        other.close()


def test_concurrent_runs_share_one_session(cuda_engine: Engine, fraud_dir: Path) -> None:
    xs = [_rows(16, i) for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda x: cuda_engine.run({"input": x}, ["probabilities"]), xs))
    got = np.concatenate([o["probabilities"] for o in outs])
    np.testing.assert_allclose(got, _cpu_answer(fraud_dir, np.concatenate(xs)), atol=1e-3)


def test_instance_group_runs_two_sessions_on_the_gpu(
    fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path
) -> None:
    doc = _on_cuda(fraud_config).model_dump()
    config = ModelConfig.model_validate({**doc, "instance_group": {"count": 2}})
    eng = _loaded(config, fraud_dir, tmp_path)
    try:
        assert isinstance(eng, EngineInstances) and len(eng.instances) == 2
        assert eng.device_kind == "gpu"
        xs = [_rows(8, i) for i in range(32)]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda x: eng.run({"input": x}, ["probabilities"]), xs))
        got = np.concatenate([o["probabilities"] for o in outs])
        np.testing.assert_allclose(got, _cpu_answer(fraud_dir, np.concatenate(xs)), atol=1e-3)
    finally:
        eng.close()


def test_bad_inputs_are_the_clients_fault(cuda_engine: Engine) -> None:
    with pytest.raises(EngineInputError):
        cuda_engine.run({"input": np.zeros((2, 3), np.float32)}, ["probabilities"])


_CHILD = """
import json, sys
from pathlib import Path
from inferbus_common.modelconfig import EngineConfig
from inferbus_worker.engines import OnnxRuntimeEngine, ProviderUnavailable
eng = OnnxRuntimeEngine(Path(sys.argv[1]), EngineConfig(providers=["cuda"]))
try:
    eng.load()
except ProviderUnavailable as exc:
    print(json.dumps({"refused": exc.message}))
else:
    print(json.dumps({"providers": eng.providers}))
"""


@pytest.mark.parametrize("scenario", ["no_visible_gpu", "no_cuda_libraries_on_path"])
def test_cuda_only_version_never_serves_on_the_cpu(fraud_dir: Path, scenario: str) -> None:
    env = dict(os.environ)
    if scenario == "no_visible_gpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["LD_LIBRARY_PATH"] = ":".join(
            p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and "/nvidia/" not in p
        )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(fraud_dir / "model.onnx")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    if scenario == "no_visible_gpu":
        # No GPU at all: refused, naming the provider.
        assert "CUDAExecutionProvider" in doc.get("refused", ""), doc
    else:
        # The libraries may still be found another way (onnxruntime preloads the
        # nvidia wheels): then CUDA really started; never the CPU.
        assert "refused" in doc or doc["providers"][0] == "CUDAExecutionProvider", doc
