"""An input's image layout (``format`` in `config.json`), as Triton's model
configuration has it.

``FORMAT_NCHW`` (channels first) or ``FORMAT_NHWC`` (channels last) says how
an image input is laid out; Triton's ``image_client`` example, and tools like
it, refuse an image model whose input says ``FORMAT_NONE``. Rules, Triton's:
a format other than ``FORMAT_NONE`` needs exactly three dimensions besides
the batch axis (C, H, W in its order), and only inputs have one.

`complete_formats` fills the format in where the graph makes it clear, as the
registry does at push: three dimensions besides the batch axis and 1 or 3
channels in exactly one of the two places (first or last). ``[-1, 3, 224,
224]`` is NCHW, ``[-1, 224, 224, 3]`` NHWC; ``[-1, 3, 3, 3]`` or
``[-1, 3, -1, -1, 5]`` stay without one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from inferbus_common.modelconfig import ModelConfig
    from inferbus_common.tensorspec import TensorSpec

Format = Literal["FORMAT_NONE", "FORMAT_NCHW", "FORMAT_NHWC"]
"""The values ``format`` may take (Triton's ``ModelInput.Format`` names)."""

NONE: Format = "FORMAT_NONE"
NCHW: Format = "FORMAT_NCHW"
NHWC: Format = "FORMAT_NHWC"

_CHANNELS = (1, 3)
"""Channel counts that mark an image axis (grey, RGB)."""


def _image_dims(spec: TensorSpec, batched: bool) -> list[int]:
    return list(spec.shape[1:] if batched else spec.shape)


def check_formats(config: ModelConfig) -> None:
    """Refuse formats that cannot hold (Triton's rules).

    Raises:
        ValueError: naming the tensor and the rule (pydantic reports it at push).
    """
    for spec in config.outputs:
        if spec.format is not None:
            raise ValueError(f"output '{spec.name}': format applies to inputs only")
    batched = config.max_batch_size > 0
    for spec in config.inputs:
        if spec.format in (NCHW, NHWC):
            dims = _image_dims(spec, batched)
            if len(dims) != 3:
                order = "C, H, W" if spec.format == NCHW else "H, W, C"
                raise ValueError(
                    f"input '{spec.name}': {spec.format} needs three dimensions besides the "
                    f"batch axis ({order}), got {dims}"
                )


def clear_format(spec: TensorSpec, batched: bool) -> Format | None:
    """The format the shape makes clear (a numeric input with channels of 1 or 3
    in exactly one place), or None when it does not."""
    dims = _image_dims(spec, batched)
    if len(dims) != 3 or spec.datatype == "BYTES":
        return None
    first, last = dims[0] in _CHANNELS, dims[2] in _CHANNELS
    if first == last:
        return None
    return NCHW if first else NHWC


def complete_formats(config: ModelConfig) -> ModelConfig:
    """`config` with the format of each input that has none filled in where
    the shape makes it clear (`clear_format`); the same object when nothing
    changes."""
    batched = config.max_batch_size > 0
    inputs = []
    changed = False
    for spec in config.inputs:
        found = clear_format(spec, batched) if spec.format is None else None
        if found is not None:
            spec = spec.model_copy(update={"format": found})
            changed = True
        inputs.append(spec)
    return config.model_copy(update={"inputs": inputs}) if changed else config
