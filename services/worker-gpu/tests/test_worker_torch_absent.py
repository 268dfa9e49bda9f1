"""A worker environment without torch: a PyTorch version is refused, clearly.

The ordinary workspace environment (.venv) never has torch (it lives in
.venvs/torch, scripts/bootstrap-torch.sh). Building the engine needs no torch;
loading it raises `TorchUnavailable`, a FAILED_PRECONDITION (the version is
then ``failed permanently`` on this worker) that names the version and says
where torch comes from. The end-to-end refusal (the worker keeps serving the
others) is in tests/e2e/test_e2e_torch.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from inferbus_common.errors import StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines import TorchEngine, TorchUnavailable, build_engine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is not None,
    reason="torch is importable in this environment (the refusal needs one without it)",
)


def test_pytorch_version_is_refused_with_failed_precondition(tmp_path: Path) -> None:
    config = ModelConfig.model_validate(
        {
            "name": "mlp",
            "engine": {"kind": "pytorch"},
            "file": "model.pt2",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        }
    )
    (tmp_path / "model.pt2").write_bytes(b"PK\x05\x06" + bytes(18))
    engine = build_engine(config, tmp_path, trt_cache_dir=tmp_path, label="mlp version 3")
    assert isinstance(engine, TorchEngine) and engine.device_kind == "cpu"
    with pytest.raises(TorchUnavailable) as caught:
        engine.load()
    assert caught.value.code == StatusCode.FAILED_PRECONDITION
    text = str(caught.value)
    assert "mlp version 3 is a PyTorch program and this worker has no torch" in text
    assert "scripts/bootstrap-torch.sh" in text and "pip install torch" in text
