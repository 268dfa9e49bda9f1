"""issue 27, worker: fp16 / int8 variants serve; `openvino` without its EP is refused."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferbus_cli import optimize
from inferbus_common.errors import FailedPrecondition
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines import ProviderUnavailable, build_engine, warmup_batch_sizes


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_reduced_precision_variant_serves(
    mode: str, fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "fp16":
            optimize.to_fp16(fraud_dir / "model.onnx", tmp_path / "model.onnx")
        else:
            optimize.to_int8(fraud_dir / "model.onnx", tmp_path / "model.onnx")
    eng = build_engine(fraud_config, tmp_path, trt_cache_dir=tmp_path / "trt")
    eng.load()
    eng.warmup(warmup_batch_sizes(fraud_config))
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    ref = ort.InferenceSession(str(fraud_dir / "model.onnx")).run(None, {"input": x})[0]
    got = eng.run({"input": x}, ["probabilities"])["probabilities"]
    assert got.dtype == np.float32 and np.abs(got - ref).max() < 0.2
    eng.close()


def test_openvino_version_is_refused_without_the_ep(
    fraud_dir: Path, fraud_config: ModelConfig, tmp_path: Path
) -> None:
    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-openvino is installed here: nothing to refuse")
    config = fraud_config.model_copy(
        update={"engine": fraud_config.engine.model_copy(update={"providers": ["openvino"]})}
    )
    eng = build_engine(config, fraud_dir, trt_cache_dir=tmp_path / "trt")
    with pytest.raises(ProviderUnavailable, match="openvino") as info:
        eng.load()
    assert isinstance(info.value, FailedPrecondition)
