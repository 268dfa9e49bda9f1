"""The GPU engine logic that a CPU machine can check with real ONNX Runtime sessions:
a GPU-only version never ends up on the CPU, instance groups run concurrently on
their own sessions, instances are placed by free GPU memory.

The only thing faked is a provider that ONNX Runtime lists but cannot start
(``get_available_providers`` claiming CUDA on this CPU build): ONNX Runtime then
drops it and opens the session on the CPU, as it does on a GPU host with no
visible GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferbus_common.gpus import GpuInfo
from inferbus_common.modelconfig import EngineConfig, ModelConfig
from inferbus_worker.engines import (
    EngineInstances,
    OnnxRuntimeEngine,
    ProviderUnavailable,
    build_engine,
    place_instances,
    warmup_batch_sizes,
)
from inferbus_worker.engines.onnx import check_session_providers
from inferbus_worker.execution import runs_on_gpu
from inferbus_worker.versionhost import failure_state


@pytest.fixture
def cuda_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU build of ONNX Runtime claims a CUDA provider it cannot start."""
    real = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])


def _with(config: ModelConfig, **update: object) -> ModelConfig:
    return ModelConfig.model_validate({**config.model_dump(), **update})


@pytest.mark.usefixtures("cuda_listed")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_cuda_only_version_that_lands_on_the_cpu_is_refused(fraud_dir: Path) -> None:
    # ONNX Runtime drops the provider with a warning and opens a CPU session.
    eng = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig(providers=["cuda"]))
    with pytest.raises(ProviderUnavailable) as refused:
        eng.load()
    assert "CUDAExecutionProvider did not start" in refused.value.message
    assert "['CPUExecutionProvider']" in refused.value.message
    assert "no 'cpu' in engine.providers" in refused.value.message
    # A permanent load failure: the version's state, and so clients, get FAILED_PRECONDITION.
    assert failure_state(refused.value).startswith("failed permanently: execution provider")


@pytest.mark.usefixtures("cuda_listed")
def test_provider_that_fails_to_start_is_quoted(fraud_dir: Path) -> None:
    # Here ONNX Runtime's warning is an error (the tests' filterwarnings): the
    # session cannot open, and its words reach the version's state.
    eng = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig(providers=["cuda"]))
    with pytest.raises(ProviderUnavailable, match=r"failed to start for model\.onnx: .*CUDA"):
        eng.load()


@pytest.mark.usefixtures("cuda_listed")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_version_that_allows_the_cpu_still_serves(fraud_dir: Path) -> None:
    eng = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig(providers=["cuda", "cpu"]))
    eng.load()
    try:
        assert eng.providers[0] == "CPUExecutionProvider"
        assert eng.device_kind == "cpu" and not runs_on_gpu(eng)
        out = eng.run({"input": np.zeros((2, 64), np.float32)}, ["probabilities"])
        assert out["probabilities"].shape == (2, 2)
    finally:
        eng.close()


@pytest.mark.usefixtures("cuda_listed")
def test_a_provider_failing_to_start_gives_way_to_the_next_listed(fraud_dir: Path) -> None:
    # Opening with CUDA fails (the warning is an error here); the config lists the
    # CPU next, so the engine opens the session on it, as the config allows.
    eng = OnnxRuntimeEngine(fraud_dir / "model.onnx", EngineConfig(providers=["cuda", "cpu"]))
    eng.load()
    try:
        assert eng.providers == ["CPUExecutionProvider"] and eng.device_kind == "cpu"
    finally:
        eng.close()


def test_session_provider_check() -> None:
    cuda = ("CUDAExecutionProvider", {"device_id": "0"})
    got_cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    check_session_providers([cuda], got_cuda, cpu_allowed=False)
    check_session_providers([cuda], ["CPUExecutionProvider"], cpu_allowed=True)
    why = [
        "2026-12-04 [E:onnxruntime:Default, cuda_call.cc:118] CUDA failure 100: no "
        "CUDA-capable device is detected"
    ]
    with pytest.raises(ProviderUnavailable, match="CUDA failure 100: no CUDA-capable device"):
        check_session_providers([cuda], ["CPUExecutionProvider"], cpu_allowed=False, why=why)
    trt = ("TensorrtExecutionProvider", {"device_id": "0"})
    # TensorRT did not start but CUDA, which the config also lists, did: it serves.
    check_session_providers([trt, cuda], got_cuda, cpu_allowed=False)
    with pytest.raises(ProviderUnavailable, match="TensorrtExecutionProvider did not start"):
        check_session_providers([trt], ["CPUExecutionProvider"], cpu_allowed=False)


class BarrierEngine(OnnxRuntimeEngine):
    """Waits inside `run` until `parties` runs are inside at once (or fails)."""

    def __init__(self, path: Path, barrier: threading.Barrier, sessions: list[object]) -> None:
        super().__init__(path, EngineConfig())
        self._barrier = barrier
        self._sessions = sessions

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        self._sessions.append(self._session)
        self._barrier.wait()  # BrokenBarrierError unless the other run is in here too
        return super().run(inputs, output_names)


def test_two_instances_run_two_batches_at_once(fraud_dir: Path) -> None:
    barrier = threading.Barrier(2, timeout=30)
    sessions: list[object] = []
    group = EngineInstances(
        [BarrierEngine(fraud_dir / "model.onnx", barrier, sessions) for _ in range(2)]
    )
    group.load()
    x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    results: list[dict[str, np.ndarray]] = []
    threads = [
        threading.Thread(target=lambda: results.append(group.run({"input": x}, ["probabilities"])))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    group.close()
    assert not barrier.broken
    assert len(results) == 2
    np.testing.assert_array_equal(results[0]["probabilities"], results[1]["probabilities"])
    # Each batch ran on its own instance's session.
    assert len({id(s) for s in sessions}) == 2


def test_instance_group_builds_one_session_per_instance(
    fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path
) -> None:
    config = _with(fraud_config, instance_group={"count": 2})
    assert config.instance_count == 2
    eng = build_engine(config, fraud_dir, trt_cache_dir=tmp_path / "trt")
    assert isinstance(eng, EngineInstances)
    eng.load()
    eng.warmup(warmup_batch_sizes(config))
    try:
        instances = eng.instances
        assert len(instances) == 2
        sessions = {id(getattr(i, "_session", None)) for i in instances}
        assert len(sessions) == 2
        assert eng.description == "2 x onnxruntime[CPUExecutionProvider]"
        assert eng.device_kind == "cpu"
        x = np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32)
        want = ort.InferenceSession(
            str(fraud_dir / "model.onnx"), providers=["CPUExecutionProvider"]
        ).run(["probabilities"], {"input": x})[0]
        got = eng.run({"input": x}, ["probabilities"])["probabilities"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        eng.close()


@pytest.mark.usefixtures("cuda_listed")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_kind_cpu_group_stays_on_the_cpu(
    fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path
) -> None:
    config = _with(
        fraud_config,
        engine={"providers": ["cuda", "cpu"]},
        instance_group={"count": 2, "kind": "KIND_CPU"},
    )
    eng = build_engine(config, fraud_dir, trt_cache_dir=tmp_path / "trt")
    eng.load()
    try:
        assert eng.device_kind == "cpu"
        assert all(i.providers == ["CPUExecutionProvider"] for i in eng.instances)  # type: ignore[attr-defined]
    finally:
        eng.close()


GPUS = [
    GpuInfo(0, "GPU-a", "NVIDIA H200", 140 << 30, 10 << 30),
    GpuInfo(1, "GPU-b", "NVIDIA H200", 140 << 30, 90 << 30),
]


def test_gpu_instances_are_placed_by_free_memory(fraud_config: ModelConfig) -> None:
    cuda = _with(fraud_config, engine={"providers": ["cuda"]})
    assert place_instances(cuda, lambda: GPUS) == [1]
    group = _with(cuda, instance_group={"count": 3})
    assert place_instances(group, lambda: GPUS) == [1, 0, 1]
    pinned = _with(cuda, engine={"providers": ["cuda"], "cuda": {"device_id": 0}})
    assert place_instances(pinned, lambda: GPUS) == [None]  # the config's own device_id
    named = _with(cuda, instance_group={"count": 2, "gpus": [0, 1]})
    assert place_instances(named, lambda: GPUS) == [0, 0, 1, 1]

    def no_lookup() -> list[GpuInfo]:
        raise AssertionError("a CPU version needs no GPU lookup")

    assert place_instances(fraud_config, no_lookup) == [None]


@pytest.mark.parametrize("graphs", [False, True], ids=["io-binding", "graph-padding"])
def test_binding_logic_on_a_cpu_session(fraud_dir: Path, graphs: bool) -> None:
    # The CUDA path's binding (buffers per shape, padding to the graph sizes, one
    # binding per thread or one shared under a lock), on CPU buffers.
    from concurrent.futures import ThreadPoolExecutor

    from inferbus_worker.engines.iobinding import CudaBinding

    path = str(fraud_dir / "model.onnx")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    binding = CudaBinding(
        session,
        0,
        dtypes={"input": np.float32, "probabilities": np.float32},
        batched=True,
        cuda_graph=graphs,
        batch_sizes=[1, 4, 32],
        device="cpu",
    )
    assert binding.description == ("io-binding+cuda-graphs" if graphs else "io-binding")

    def check(batch: int) -> None:
        x = np.random.default_rng(batch).normal(size=(batch, 64)).astype(np.float32)
        view = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(batch, 64)
        got = binding.run({"input": view}, ["probabilities"])["probabilities"]
        assert got.shape == (batch, 2)
        np.testing.assert_allclose(got, session.run(None, {"input": x})[0], rtol=1e-6)

    for batch in (1, 3, 4, 32, 2, 3, 1):  # repeated shapes reuse their buffers
        check(batch)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(check, [1, 2, 3, 4, 5, 6, 7, 8] * 4))
    binding.close()


def test_plan_instances_per_gpu(fraud_config: ModelConfig, tmp_path: Path) -> None:
    from inferbus_worker.engines import TensorRTEngine

    config = _with(
        fraud_config,
        file="model.plan",
        engine={"kind": "tensorrt"},
        instance_group={"count": 2, "gpus": [0, 1]},
    )
    eng = build_engine(config, tmp_path, trt_cache_dir=tmp_path / "trt")
    assert isinstance(eng, EngineInstances)
    plans = eng.instances
    assert all(isinstance(p, TensorRTEngine) for p in plans)
    assert [p.description for p in plans] == ["tensorrt[cuda:0]", "tensorrt[cuda:1]"]
    assert config.instance_count == 4 and eng.device_kind == "gpu"


def test_an_instance_taking_several_runs(fraud_dir: Path) -> None:
    barrier = threading.Barrier(2, timeout=30)
    sessions: list[object] = []
    group = EngineInstances(
        [BarrierEngine(fraud_dir / "model.onnx", barrier, sessions)], runs_each=2
    )
    group.load()
    x = np.zeros((1, 64), np.float32)
    threads = [
        threading.Thread(target=group.run, args=({"input": x}, ["probabilities"])) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    group.close()
    assert not barrier.broken and len(sessions) == 2
