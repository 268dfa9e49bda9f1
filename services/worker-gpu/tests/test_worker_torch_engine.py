"""`TorchEngine` on real programs, in the PyTorch environment (.venvs/torch).

pytest runs in the workspace's environment, which has no torch, so each
check runs as a script with ``.venvs/torch/bin/python`` (the engine, the
programs and torch all real) and prints what it saw as JSON; the assertions
are here. Skips when .venvs/torch is missing; the CUDA check skips unless
that torch sees a GPU (the CPU wheel never does).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from inferbus_testing.torchmodels import TORCH_MISSING, TORCH_PYTHON, build_torch_mlp

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TORCH_PYTHON.exists(), reason=TORCH_MISSING),
]

_PRELUDE = """
import json, sys, warnings
from pathlib import Path
import numpy as np, torch
from inferbus_common.modelconfig import ModelConfig
from inferbus_worker.engines import build_engine

def config(directory, **changes):
    doc = json.loads((Path(directory) / "config.json").read_text())
    return ModelConfig.model_validate({**doc, "name": "m", **changes})

def engine(directory, **changes):
    return build_engine(config(directory, **changes), Path(directory),
                        trt_cache_dir=Path(directory) / "trt", label="m version 1")

def failure(fn):
    try:
        fn()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None
"""


def _run(script: str) -> Any:
    done = subprocess.run(
        [str(TORCH_PYTHON), "-c", _PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torch-programs")
    build_torch_mlp(root / "pt", "pt", "--logits")  # answers a dict
    build_torch_mlp(root / "pt2", "pt2", "--logits")  # answers a tuple
    build_torch_mlp(root / "one", "pt")  # answers one tensor
    return root


def test_outputs_by_name_position_and_alone_match_the_program(programs: Path) -> None:
    seen = _run(
        f"""
        out = {{}}
        x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
        ro = np.frombuffer(x.tobytes(), np.float32).reshape(5, 64)  # read-only, as a request's
        for name in ("pt", "pt2", "one"):
            d = Path({str(programs)!r}) / name
            e = engine(d)
            e.load(); e.warmup([1, 8, 32])
            names = ["probabilities", "logits"] if name != "one" else ["probabilities"]
            got = e.run({{"input": ro}}, names)
            prog = (torch.jit.load(str(d / "model.pt")) if name != "pt2"
                    else torch.export.load(str(d / "model.pt2")).module())
            want = prog(torch.from_numpy(x))
            want = (want if isinstance(want, dict) else
                    dict(zip(names, want if isinstance(want, tuple) else [want])))
            out[name] = {{
                "description": e.description, "device_kind": e.device_kind,
                "diff": max(float(np.abs(got[k] - want[k].detach().numpy()).max()) for k in names),
                "dtypes": [str(got[k].dtype) for k in names],
                "only_logits": (
                    sorted(e.run({{"input": ro}}, ["logits"])) if name != "one" else None
                ),
            }}
            e.close()
        print(json.dumps(out))
        """
    )
    assert seen["pt"]["description"] == "torch 2.13.0+cpu[torchscript on cpu]"
    assert seen["pt2"]["description"] == "torch 2.13.0+cpu[torch.export on cpu]"
    for name in ("pt", "pt2", "one"):
        assert seen[name]["device_kind"] == "cpu"
        assert seen[name]["diff"] == 0.0, seen[name]  # the same program on the same rows
        assert set(seen[name]["dtypes"]) == {"float32"}
    assert seen["pt"]["only_logits"] == seen["pt2"]["only_logits"] == ["logits"]


def test_programs_that_contradict_the_config_are_refused_at_load(programs: Path) -> None:
    seen = _run(
        f"""
        root = Path({str(programs)!r})
        def loaded(d, **changes):
            e = engine(root / d, **changes); e.load(); e.warmup([1, 32])
        one_output = [{{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}}]
        fp64 = [{{"name": "probabilities", "datatype": "FP64", "shape": [-1, 2]}},
                {{"name": "logits", "datatype": "FP32", "shape": [-1, 2]}}]
        narrow = [{{"name": "input", "datatype": "FP32", "shape": [-1, 8]}}]
        print(json.dumps({{
            "count": failure(lambda: loaded("pt2", outputs=one_output)),
            "dtype": failure(lambda: loaded("pt", outputs=fp64)),
            "shape": failure(lambda: loaded("one", inputs=narrow)),
            "cuda_only": failure(lambda: loaded("one", engine={{"kind": "pytorch",
                                                               "providers": ["cuda"]}})),
            "cuda_then_cpu": [engine(root / "one", engine={{"kind": "pytorch",
                               "providers": ["cuda", "cpu"]}}).device_kind] +
                               [failure(lambda: loaded("one", engine={{"kind": "pytorch",
                               "providers": ["cuda", "cpu"]}}))],
            "garbage": failure(lambda: (Path(root / "one" / "bad.pt").write_bytes(b"junk"),
                                        loaded("one", file="bad.pt"))),
        }}))
        """
    )
    assert seen["count"][0] == "EngineError"
    assert "returns 2 value(s); config.json names 1 output(s)" in seen["count"][1]
    assert seen["dtype"][0] == "EngineError"
    assert "gives float32 for output 'probabilities'; config.json says FP64" in seen["dtype"][1]
    assert seen["shape"][0] == "EngineError" and "warm-up failed on zeros" in seen["shape"][1]
    if seen["cuda_only"] is not None:  # None: this torch sees a GPU (then it loaded there)
        assert seen["cuda_only"][0] == "ProviderUnavailable"
        assert "sees no CUDA device" in seen["cuda_only"][1]
        assert "does not allow the CPU" in seen["cuda_only"][1]
    # cuda then cpu: loads (on the CPU where torch sees no GPU).
    assert seen["cuda_then_cpu"][1] is None
    assert seen["garbage"][0] == "EngineError"
    assert "cannot load bad.pt as a torchscript program" in seen["garbage"][1]


def test_cuda_device_when_torch_sees_a_gpu(programs: Path) -> None:
    sees = _run("print(json.dumps(torch.cuda.is_available()))")
    if not sees:
        pytest.skip(
            "the torch of .venvs/torch sees no CUDA device (CPU wheel or no GPU): the "
            "CUDA path of TorchEngine is not exercised here"
        )
    seen = _run(
        f"""
        e = engine(Path({str(programs)!r}) / "pt2", engine={{"kind": "pytorch",
                                                            "providers": ["cuda"]}})
        e.load(); e.warmup([1, 32])
        x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
        got = e.run({{"input": x}}, ["probabilities"])["probabilities"]
        cpu = engine(Path({str(programs)!r}) / "pt2"); cpu.load()
        want = cpu.run({{"input": x}}, ["probabilities"])["probabilities"]
        print(json.dumps([e.device_kind, e.description, float(np.abs(got - want).max())]))
        """
    )
    assert seen[0] == "gpu" and "on cuda:0" in seen[1]
    assert seen[2] < 1e-3  # TF32 / different kernels on the GPU
