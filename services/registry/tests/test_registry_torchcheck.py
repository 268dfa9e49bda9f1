"""PyTorch artifacts read at push without torch (`inferbus_registry.torchcheck`).

The refusals need no torch (archives written here); the checks of real
programs build them with .venvs/torch and skip without it.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_registry.torchcheck import check_torch_file, derive_torch_config
from inferbus_testing.torchmodels import TORCH_MISSING, TORCH_PYTHON, build_torch_mlp


def _config(file: str, **extra: object) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "engine": {"kind": "pytorch"},
            "file": file,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}],
            **extra,
        }
    )


def test_a_file_that_is_no_archive_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a zip")
    with pytest.raises(InvalidArgument, match=r"not a TorchScript or torch\.export archive"):
        check_torch_file(path, _config("model.pt"), "m")


def test_a_saved_state_dict_is_refused_saying_what_to_push(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as archive:  # what torch.save writes: pickles, no code/
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        archive.writestr("archive/data/0", b"\x00" * 16)
    with pytest.raises(InvalidArgument, match=r"no TorchScript code .*torch.jit.script"):
        check_torch_file(path, _config("model.pt"), "m")


def test_torchscript_records_no_shapes_so_no_config_is_derived(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"push a config\.json"):
        derive_torch_config(tmp_path / "model.pt", "m")


def test_an_unknown_pt2_layout_is_taken_as_the_config_says(tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("m/models/model.json", json.dumps({"format": "from another torch"}))
    check_torch_file(path, _config("model.pt2"), "m")  # not refused: not checkable
    with pytest.raises(InvalidArgument, match="cannot read the signature"):
        derive_torch_config(path, "m")


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not TORCH_PYTHON.exists():
        pytest.skip(TORCH_MISSING)
    root = tmp_path_factory.mktemp("programs")
    build_torch_mlp(root / "pt", "pt")
    build_torch_mlp(root / "pt2", "pt2", "--logits")
    return root


def test_real_programs_pass_and_a_pt2_signature_is_compared(programs: Path) -> None:
    check_torch_file(programs / "pt" / "model.pt", _config("model.pt"), "m")
    pt2 = programs / "pt2" / "model.pt2"
    logits = {"name": "logits", "datatype": "FP32", "shape": [-1, 2]}
    good = _config(
        "model.pt2",
        outputs=[{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}, logits],
    )
    check_torch_file(pt2, good, "m")
    with pytest.raises(InvalidArgument, match=r"names 1 output\(s\)"):
        check_torch_file(pt2, _config("model.pt2"), "m")
    wrong = ModelConfig.model_validate(
        {**good.model_dump(), "inputs": [{"name": "x", "datatype": "FP64", "shape": [-1, 64]}]}
    )
    with pytest.raises(InvalidArgument, match=r"is FP32 in the program, FP64 in config\.json"):
        check_torch_file(pt2, wrong, "m")
    narrow = ModelConfig.model_validate(
        {**good.model_dump(), "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]}
    )
    with pytest.raises(InvalidArgument, match=r"has shape \[-1, 64\] in the program"):
        check_torch_file(pt2, narrow, "m")
    derived = derive_torch_config(pt2, "m")
    assert [s.name for s in derived.outputs] == ["softmax", "linear_1"]
    assert derived.max_batch_size == 32 and derived.platform == "pytorch_libtorch"


def test_a_batching_config_needs_axis_0_to_take_its_batches(programs: Path) -> None:
    small = build_torch_mlp(programs / "max16", "pt2", "--max-batch", "16", "--no-config")
    pt2 = small / "model.pt2"
    derived = derive_torch_config(pt2, "m")
    assert derived.max_batch_size == 16  # the program's own bound, under the usual 32
    check_torch_file(pt2, derived, "m")
    with pytest.raises(InvalidArgument, match=r"takes 1\.\.16 rows on axis 0.*1\.\.32"):
        check_torch_file(pt2, _config("model.pt2"), "m")  # max_batch_size 32
    fixed = ModelConfig.model_validate(
        {
            **_config("model.pt2").model_dump(),
            "max_batch_size": 0,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 64]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [3, 2]}],
        }
    )
    check_torch_file(pt2, fixed, "m")  # literal shapes: the dynamic axis takes 3 rows
