"""The engine section (provider options, instance groups) and GPU discovery helpers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from inferbus_common.engineconfig import (
    CudaOptions,
    EngineConfig,
    TensorRTOptions,
    instance_device_kind,
)
from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_common.gpus import GpuInfo, parse_smi, roomiest, select_gpus, visible_gpus
from inferbus_common.modelconfig import ModelConfig

BASE = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
}


def _config(**extra: object) -> ModelConfig:
    return ModelConfig.model_validate({**BASE, **extra})


def test_configs_without_options_dump_as_before() -> None:
    # No new keys: the registry's canonical config.json (and digests) stay the same.
    dumped = json.loads(_config().model_dump_json())
    assert set(dumped["engine"]) == {"kind", "providers", "intra_op_threads", "inter_op_threads"}
    assert "instance_group" not in dumped


def test_cuda_options_map_to_onnxruntime_names() -> None:
    config = _config(
        engine={
            "providers": ["cuda"],
            "cuda": {
                "use_tf32": False,
                "cudnn_conv_algo_search": "HEURISTIC",
                "gpu_mem_limit": 2 << 30,
                "arena_extend_strategy": "kSameAsRequested",
                "enable_cuda_graph": True,
                "device_id": 1,
            },
        }
    )
    assert config.engine.cuda is not None
    assert config.engine.cuda.provider_options() == {
        "device_id": "1",
        "use_tf32": "0",
        "cudnn_conv_algo_search": "HEURISTIC",
        "gpu_mem_limit": str(2 << 30),
        "arena_extend_strategy": "kSameAsRequested",
        "enable_cuda_graph": "1",
    }
    # An instance placed elsewhere overrides the device only.
    assert config.engine.cuda.provider_options(device_id=3)["device_id"] == "3"
    again = ModelConfig.model_validate_json(config.model_dump_json())
    assert again.engine == config.engine


def test_tensorrt_options_map_to_onnxruntime_names() -> None:
    opts = TensorRTOptions(
        fp16=True, int8=False, max_workspace_bytes=1 << 30, builder_optimization_level=5
    )
    got = opts.provider_options("/cache")
    assert got["trt_fp16_enable"] == "1"
    assert got["trt_int8_enable"] == "0"
    assert got["trt_max_workspace_size"] == str(1 << 30)
    assert got["trt_builder_optimization_level"] == "5"
    assert got["trt_engine_cache_path"] == got["trt_timing_cache_path"] == "/cache"
    no_cache = TensorRTOptions(engine_cache=False, timing_cache=False).provider_options("/cache")
    assert "trt_engine_cache_enable" not in no_cache and "trt_timing_cache_enable" not in no_cache
    assert "trt_engine_cache_path" not in TensorRTOptions().provider_options(None)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"providers": ["cpu"], "cuda": {}}, "does not use the cuda provider"),
        ({"providers": ["cuda"], "tensorrt": {}}, "does not use the tensorrt provider"),
        ({"providers": ["cuda"], "cuda": {"use_tf33": False}}, "use_tf33"),
        ({"providers": ["cuda"], "cuda": {"cudnn_conv_algo_search": "FAST"}}, "EXHAUSTIVE"),
        ({"providers": ["cuda"], "cuda": {"gpu_mem_limit": 0}}, "gpu_mem_limit"),
        ({"providers": ["cuda"], "cuda": {"device_id": -1}}, "device_id"),
        ({"providers": ["tensorrt"], "tensorrt": {"builder_optimization_level": 6}}, "less"),
        ({"kind": "tensorrt", "tensorrt": {"fp16": True}}, "only engine.tensorrt.device_id"),
        ({"kind": "tensorrt", "cuda": {}}, "does not apply to kind 'tensorrt'"),
        ({"providers": []}, "at least one provider"),
        ({"providers": ["cuda", "cuda"]}, "twice"),
    ],
)
def test_bad_engine_options_are_refused_with_the_reason(engine: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _config(engine=engine)


def test_native_tensorrt_takes_a_device() -> None:
    config = _config(engine={"kind": "tensorrt", "tensorrt": {"device_id": 1}})
    assert config.engine.device_kind == "gpu"


def test_device_kind_is_one_vocabulary() -> None:
    assert EngineConfig().device_kind == "cpu"
    assert EngineConfig(providers=["cuda", "cpu"]).device_kind == "gpu"
    assert EngineConfig(providers=["cpu", "cuda"]).device_kind == "cpu"
    assert EngineConfig(providers=["tensorrt"]).device_kind == "gpu"
    assert EngineConfig(providers=["cuda"]).cpu_allowed is False
    assert EngineConfig(providers=["cuda", "cpu"]).cpu_allowed is True
    cpu_group = _config(engine={"providers": ["cuda", "cpu"]}, instance_group={"kind": "KIND_CPU"})
    assert instance_device_kind(cpu_group) == "cpu"
    assert CudaOptions().use_tf32 is True  # ONNX Runtime's own default, documented


def test_instance_group_sets_the_executions() -> None:
    config = _config(instance_group={"count": 2})
    assert config.instance_count == 2
    assert config.instance_group is not None and config.instance_group.instances == 2
    per_gpu = _config(engine={"providers": ["cuda"]}, instance_group={"count": 2, "gpus": [0, 1]})
    assert per_gpu.instance_count == 4
    # What the registry stores reads back the same.
    assert ModelConfig.model_validate_json(per_gpu.model_dump_json()) == per_gpu


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"instance_group": {"count": 0}}, "greater than or equal to 1"),
        ({"instance_group": {"count": 2}, "instance_count": 3}, "contradicts instance_group"),
        ({"instance_group": {"kind": "KIND_GPU"}}, "KIND_GPU needs a GPU provider"),
        ({"instance_group": {"gpus": [0]}}, "gpus needs a GPU provider"),
        (
            {"engine": {"providers": ["cuda"]}, "instance_group": {"kind": "KIND_CPU"}},
            "KIND_CPU needs",
        ),
        (
            {"engine": {"providers": ["cuda", "cpu"]}, "instance_group": {"gpus": [0, 0]}},
            "names a GPU twice",
        ),
        ({"instance_group": {"kind": "KIND_TPU"}}, "KIND_AUTO"),
    ],
)
def test_bad_instance_groups_are_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _config(**extra)


H200 = [
    GpuInfo(0, "GPU-aaaa-1111", "NVIDIA H200", 140 << 30, 100 << 30),
    GpuInfo(1, "GPU-bbbb-2222", "NVIDIA H200", 140 << 30, 130 << 30),
    GpuInfo(2, "GPU-cccc-3333", "NVIDIA H200", 140 << 30, 120 << 30),
]


def test_nvidia_smi_output_is_parsed() -> None:
    text = (
        "0, GPU-aaaa-1111, NVIDIA H200, 143771, 143000\n"
        "1, GPU-bbbb-2222, NVIDIA H200, 143771, [N/A]\n"
        "garbage line\n"
    )
    gpus = parse_smi(text)
    assert [g.uuid for g in gpus] == ["GPU-aaaa-1111", "GPU-bbbb-2222"]
    assert gpus[0].memory_total_bytes == 143771 << 20
    assert gpus[1].memory_free_bytes == 0


def test_cuda_visible_devices_selects_by_index_or_uuid() -> None:
    assert visible_gpus(H200, None) == H200
    assert visible_gpus(H200, "") == []
    assert visible_gpus(H200, "2,0") == [H200[2], H200[0]]
    assert visible_gpus(H200, "GPU-bbbb") == [H200[1]]
    # Like the CUDA runtime: the list ends at the first entry naming no device.
    assert visible_gpus(H200, "1,7,0") == [H200[1]]


def test_gpus_selection_for_up() -> None:
    assert select_gpus("all", H200) == H200
    assert select_gpus("2, 0", H200) == [H200[2], H200[0]]
    assert select_gpus("GPU-cccc", H200) == [H200[2]]
    with pytest.raises(InvalidArgument, match="no single GPU '5'"):
        select_gpus("0,5", H200)
    with pytest.raises(InvalidArgument, match="named twice"):
        select_gpus("1,1", H200)
    with pytest.raises(FailedPrecondition, match="no NVIDIA GPU found on this machine"):
        select_gpus("all", [])


def test_instances_go_to_the_roomiest_gpus_first() -> None:
    assert roomiest(H200, 1) == [1]
    assert roomiest(H200, 4) == [1, 2, 0, 1]
    assert roomiest([], 2) == [0, 0]


def test_pytorch_kind_fills_triton_platform_and_file() -> None:
    config = _config(engine={"kind": "pytorch"})
    assert (config.platform, config.file) == ("pytorch_libtorch", "model.pt")
    assert config.engine.device_kind == "cpu" and config.engine.cpu_allowed
    exported = _config(engine={"kind": "pytorch", "providers": ["cuda", "cpu"]}, file="model.pt2")
    assert exported.file == "model.pt2" and exported.engine.device_kind == "gpu"
    # The canonical dump re-reads to the same config (platform now explicit).
    again = ModelConfig.model_validate_json(exported.model_dump_json())
    assert again == exported


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"engine": {"kind": "pytorch", "providers": ["tensorrt"]}}, "computes on"),
        ({"engine": {"kind": "pytorch"}, "file": "model.onnx"}, "TorchScript .pt"),
        ({"file": "model.pt"}, "set engine.kind to 'pytorch'"),
        ({"engine": {"kind": "onnxruntime"}, "file": "model.pt2"}, "PyTorch program"),
        (
            {"engine": {"kind": "pytorch", "providers": ["cuda"], "cuda": {"use_tf32": False}}},
            "only engine.cuda.device_id",
        ),
        (
            {
                "engine": {"kind": "pytorch"},
                "inputs": [{"name": "t", "datatype": "BYTES", "shape": [-1, 1]}],
            },
            "no string tensors",
        ),
    ],
)
def test_pytorch_configs_that_do_not_fit_are_refused(extra: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        _config(**extra)


def test_pytorch_cuda_device_id_and_cpu_instance_group_are_accepted() -> None:
    config = _config(
        engine={"kind": "pytorch", "providers": ["cuda", "cpu"], "cuda": {"device_id": 1}},
        instance_group={"count": 2, "kind": "KIND_CPU"},
    )
    assert instance_device_kind(config) == "cpu" and config.instance_count == 2
