"""An input's image format in config.json: validated, completed, omitted when unset."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from inferbus_common.imageformat import complete_formats
from inferbus_common.modelconfig import ModelConfig


def _config(shape: list[int], fmt: str | None = None, **extra: Any) -> ModelConfig:
    spec: dict[str, Any] = {"name": "image", "datatype": "FP32", "shape": shape}
    if fmt is not None:
        spec["format"] = fmt
    return ModelConfig.model_validate(
        {
            "inputs": [spec],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 4]}],
            **extra,
        }
    )


@pytest.mark.parametrize(
    ("shape", "fmt"),
    [([-1, 3, 8, 8], "FORMAT_NCHW"), ([-1, 8, 8, 1], "FORMAT_NHWC"), ([-1, 2, 2], "FORMAT_NONE")],
)
def test_declared_formats_are_kept(shape: list[int], fmt: str) -> None:
    config = _config(shape, fmt)
    assert config.inputs[0].format == fmt
    assert ModelConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize(
    ("shape", "fmt", "message"),
    [
        (
            [-1, 3, 8],
            "FORMAT_NCHW",
            r"FORMAT_NCHW needs three dimensions .*\(C, H, W\), got \[3, 8\]",
        ),
        ([-1, 8, 8, 3, 1], "FORMAT_NHWC", r"FORMAT_NHWC needs three dimensions"),
        ([-1, 3, 8, 8], "FORMAT_CHW", r"format"),
    ],
)
def test_impossible_formats_are_refused(shape: list[int], fmt: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _config(shape, fmt)


def test_an_output_has_no_format() -> None:
    with pytest.raises(ValidationError, match="format applies to inputs only"):
        ModelConfig.model_validate(
            {
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
                "outputs": [
                    {
                        "name": "y",
                        "datatype": "FP32",
                        "shape": [-1, 3, 4, 4],
                        "format": "FORMAT_NCHW",
                    }
                ],
            }
        )


@pytest.mark.parametrize(
    ("shape", "batch", "found"),
    [
        ([-1, 3, 224, 224], 8, "FORMAT_NCHW"),
        ([-1, -1, -1, 3], 8, "FORMAT_NHWC"),
        ([1, 28, 28], 0, "FORMAT_NCHW"),  # no batch axis: the three dims are C, H, W
        ([-1, 3, 3, 3], 8, None),  # channels could be first or last
        ([-1, 5, 8, 8], 8, None),  # no 1 or 3 in either place
        ([-1, 3, 8], 8, None),  # not an image
    ],
)
def test_formats_are_completed_where_the_shape_makes_them_clear(
    shape: list[int], batch: int, found: str | None
) -> None:
    config = complete_formats(_config(shape, max_batch_size=batch) if batch else _unbatched(shape))
    assert config.inputs[0].format == found


def _unbatched(shape: list[int]) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "max_batch_size": 0,
            "inputs": [{"name": "image", "datatype": "FP32", "shape": shape}],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [4]}],
        }
    )


def test_a_declared_format_is_never_overridden_and_unset_is_not_dumped() -> None:
    config = complete_formats(_config([-1, 3, 8, 8], "FORMAT_NONE"))
    assert config.inputs[0].format == "FORMAT_NONE"
    plain = _config([-1, 5, 8, 8])
    assert complete_formats(plain) is plain
    assert "format" not in plain.model_dump(mode="json")["inputs"][0]
