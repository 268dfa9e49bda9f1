"""A model's pre/post-processing section (`ProcessingConfig`) and its steps.

The steps the worker runs around the engine (tokenize, image, softmax, top-k)
and `check_processing`, which checks a `ModelConfig`'s processing section
against its tensors (`inferbus_common.modelconfig`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from inferbus_common.tensorspec import TensorSpec

if TYPE_CHECKING:
    from inferbus_common.modelconfig import ModelConfig


class TokenizeStep(BaseModel):
    """Pre-processing: text → token ids with a `tokenizers` ``tokenizer.json``.

    The client sends one UTF-8 text per row (a BYTES input of shape ``[-1]`` or
    ``[-1, 1]``); the engine gets INT64 ``ids`` (and ``mask`` when named) of
    shape ``[-1, max_length]``, truncated and padded with ``pad_id``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tokenize"]
    input: str = Field(min_length=1)
    """Client-facing BYTES input holding the texts."""
    tokenizer: str = "tokenizer.json"
    """Tokenizer file inside the version directory."""
    max_length: int = Field(ge=1, le=1 << 16)
    """Every row is truncated or padded to exactly this many tokens."""
    ids: str = "input_ids"
    """Engine-facing INT64 input receiving the token ids."""
    mask: str | None = "attention_mask"
    """Engine-facing INT64 input receiving the attention mask (None: not produced)."""
    pad_id: int = Field(default=0, ge=0)
    """Token id used for padding."""

    def produces(self) -> dict[str, tuple[str, list[int]]]:
        """Engine inputs this step writes: name → (datatype, shape)."""
        out = {self.ids: ("INT64", [-1, self.max_length])}
        if self.mask:
            out[self.mask] = ("INT64", [-1, self.max_length])
        return out


class ImageStep(BaseModel):
    """Pre-processing: images → a normalised FP32 tensor.

    The client sends either UINT8 pixels ``[-1, H, W, C]`` (any size, resized
    here) or encoded images (PNG, JPEG, ...) as a BYTES input of shape ``[-1]``
    or ``[-1, 1]``. Each image is resized to `height` x `width` (bilinear),
    then ``(pixel * scale - mean) / std`` per channel, laid out as `layout`.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["image"]
    input: str = Field(min_length=1)
    """Client-facing UINT8 or BYTES input."""
    output: str = Field(min_length=1)
    """Engine-facing FP32 input."""
    height: int = Field(ge=1, le=16384)
    width: int = Field(ge=1, le=16384)
    channels: Literal[1, 3] = 3
    """1: grayscale (PIL mode ``L``), 3: RGB."""
    scale: float = 1.0 / 255.0
    mean: list[float] = Field(default_factory=lambda: [0.0])
    """Per-channel mean (one value applies to every channel)."""
    std: list[float] = Field(default_factory=lambda: [1.0])
    """Per-channel standard deviation (one value applies to every channel)."""
    layout: Literal["NCHW", "NHWC"] = "NCHW"

    @model_validator(mode="after")
    def _channels(self) -> ImageStep:
        for field_name in ("mean", "std"):
            values = getattr(self, field_name)
            if len(values) not in (1, self.channels):
                raise ValueError(
                    f"image step '{self.input}': {field_name} needs 1 or {self.channels} values, "
                    f"got {len(values)}"
                )
        if any(s == 0 for s in self.std):
            raise ValueError(f"image step '{self.input}': std must not contain 0")
        return self

    def output_shape(self) -> list[int]:
        """Shape of the produced tensor, batch axis first."""
        if self.layout == "NCHW":
            return [-1, self.channels, self.height, self.width]
        return [-1, self.height, self.width, self.channels]

    def produces(self) -> dict[str, tuple[str, list[int]]]:
        """Engine inputs this step writes: name → (datatype, shape)."""
        return {self.output: ("FP32", self.output_shape())}


class SoftmaxStep(BaseModel):
    """Post-processing: softmax over the last axis (numerically stable, FP32)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["softmax"]
    input: str = Field(min_length=1)
    """Tensor to normalise (an engine output or an earlier step's output)."""
    output: str | None = None
    """Name of the result; None replaces `input`."""

    def produces(self) -> dict[str, str]:
        """Tensors this step writes: name → datatype."""
        return {self.output or self.input: "FP32"}


class TopKStep(BaseModel):
    """Post-processing: the `k` best classes of each row, best first.

    Writes FP32 `scores` ``[-1, k]`` and, with a `labels` file (one label per
    line, line i naming class i), BYTES `labels_output` ``[-1, k]``; the class
    indexes too when `indices` is named.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["topk"]
    input: str = Field(min_length=1)
    """Scores per class, ``[-1, classes]``."""
    k: int = Field(default=1, ge=1)
    labels: str | None = "labels.txt"
    """Labels file inside the version directory (None: no label output)."""
    labels_output: str = "label"
    scores: str = "score"
    indices: str | None = None
    """INT64 output with the class indexes (None: not produced)."""

    def produces(self) -> dict[str, str]:
        """Tensors this step writes: name → datatype."""
        out = {self.scores: "FP32"}
        if self.labels:
            out[self.labels_output] = "BYTES"
        if self.indices:
            out[self.indices] = "INT64"
        return out


PreStep = Annotated[TokenizeStep | ImageStep, Field(discriminator="kind")]
PostStep = Annotated[SoftmaxStep | TopKStep, Field(discriminator="kind")]

PYTHON_FILE = "preprocessor.py"
"""The conventional name of a version's Python processing file (issue 27)."""


class ProcessingConfig(BaseModel):
    """Pre/post-processing the worker runs around the engine, on the whole micro-batch.

    The model's `inputs`/`outputs` stay what clients send and get (the gateway
    and the batcher validate those); `engine_inputs`/`engine_outputs` are what
    the engine (the ONNX graph) takes and gives. Client inputs no pre step
    consumes are handed to the engine unchanged, so they must be engine inputs
    too; client outputs must exist after the post steps ran.
    """

    model_config = ConfigDict(extra="forbid")

    pre: list[PreStep] = Field(default_factory=list)
    post: list[PostStep] = Field(default_factory=list)
    engine_inputs: list[TensorSpec] | None = None
    """Required with `pre` steps; None means the same as the client inputs."""
    engine_outputs: list[TensorSpec] | None = None
    """Required with `post` steps; None means the same as the client outputs."""
    python: str | None = None
    """A Python file of the version directory (``preprocessor.py``) defining
    ``preprocess(inputs) -> inputs`` and/or ``postprocess(outputs) -> outputs``
    on numpy batches, run by the worker in sandboxed subprocesses
    (``inferbus_worker.scriptpool``). `inputs`/`outputs` stay the client's
    tensors, `engine_inputs`/`engine_outputs` (when they differ) are what
    ``preprocess`` returns and ``postprocess`` takes. Not combined with `pre` /
    `post` steps. The registry fills it in when a push sends ``preprocessor.py``."""

    @field_validator("python")
    @classmethod
    def _python_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = PurePosixPath(value)
        if parts.is_absolute() or ".." in parts.parts or not value.endswith(".py"):
            raise ValueError(
                f"processing.python {value!r} must be a .py file inside the version directory"
            )
        return value

    @model_serializer(mode="wrap")
    def _omit_python(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave `python` out of dumps when unset (configs from before it serialise as
        before: same digests, readable by services of the previous release)."""
        data: dict[str, Any] = handler(self)
        if isinstance(data, dict) and data.get("python", 0) is None:
            del data["python"]
        return data

    def files(self) -> list[str]:
        """Files of the version directory the steps read (tokenizers, labels, the
        Python file)."""
        out: list[str] = [self.python] if self.python else []
        for step in self.pre:
            if isinstance(step, TokenizeStep):
                out.append(step.tokenizer)
        for post_step in self.post:
            if isinstance(post_step, TopKStep) and post_step.labels:
                out.append(post_step.labels)
        return sorted(set(out))


def _shape_fits(spec_shape: list[int], shape: list[int]) -> bool:
    """Whether a declared shape admits a produced one (-1 on either side matches)."""
    return len(spec_shape) == len(shape) and all(
        a == -1 or b == -1 or a == b for a, b in zip(spec_shape, shape, strict=True)
    )


def _check_python(config: ModelConfig, proc: ProcessingConfig) -> None:
    """A `python` processing file: no declarative steps; engine tensors well formed.

    What ``preprocess`` returns is checked against `engine_inputs` per batch
    by the worker (names, datatypes, non-batch dims, rows kept); which of the
    two functions the file defines is checked by the registry at push.
    """
    if proc.pre or proc.post:
        raise ValueError(
            f"processing.python ({proc.python}) cannot be combined with processing.pre / "
            "processing.post steps: do that processing in the Python file"
        )
    if config.sequence_batching is not None:
        raise ValueError(
            f"processing.python ({proc.python}) is not run for sequence_batching models"
        )
    for label, specs in (
        ("engine_inputs", config.engine_inputs()),
        ("engine_outputs", config.engine_outputs()),
    ):
        if len({s.name for s in specs}) != len(specs):
            raise ValueError(f"processing.{label} names must be unique")
        if config.max_batch_size > 0:
            for tensor in specs:
                if not tensor.shape or tensor.shape[0] != -1:
                    raise ValueError(
                        f"engine tensor '{tensor.name}': with max_batch_size > 0 the first "
                        "dimension is the batch axis and must be -1"
                    )


def check_processing(config: ModelConfig) -> None:
    """Check the processing section is consistent with the model's tensors.

    Raises:
        ValueError: naming the step or tensor that does not fit (pydantic
            turns it into the config's validation error).
    """
    proc = config.processing
    if proc is None:
        return
    if proc.python is not None:
        _check_python(config, proc)
        return
    if (proc.pre or proc.post) and config.max_batch_size <= 0:
        raise ValueError("processing steps run per row: they need max_batch_size > 0")
    if proc.pre and proc.engine_inputs is None:
        raise ValueError("processing.pre needs processing.engine_inputs (what the engine takes)")
    if proc.post and proc.engine_outputs is None:
        raise ValueError("processing.post needs processing.engine_outputs (what the engine gives)")
    client_in = {s.name: s for s in config.inputs}
    engine_in = {s.name: s for s in config.engine_inputs()}
    engine_out = {s.name: s for s in config.engine_outputs()}
    if len(engine_in) != len(config.engine_inputs()):
        raise ValueError("processing.engine_inputs names must be unique")
    if len(engine_out) != len(config.engine_outputs()):
        raise ValueError("processing.engine_outputs names must be unique")
    if config.max_batch_size > 0:
        for tensor in [*config.engine_inputs(), *config.engine_outputs()]:
            if not tensor.shape or tensor.shape[0] != -1:
                raise ValueError(
                    f"engine tensor '{tensor.name}': with max_batch_size > 0 the first "
                    "dimension is the batch axis and must be -1"
                )
    consumed: set[str] = set()
    produced: dict[str, tuple[str, list[int]]] = {}
    for step in proc.pre:
        where = f"processing.pre {step.kind} step"
        src = client_in.get(step.input)
        if src is None:
            raise ValueError(
                f"{where}: input '{step.input}' is not a model input; inputs: {sorted(client_in)}"
            )
        if step.input in consumed:
            raise ValueError(f"{where}: input '{step.input}' is consumed by two steps")
        consumed.add(step.input)
        one_per_row = src.datatype == "BYTES" and src.shape in ([-1], [-1, 1])
        if isinstance(step, TokenizeStep) and not one_per_row:
            raise ValueError(
                f"{where}: input '{step.input}' must be BYTES with shape [-1] or [-1, 1] "
                f"(one text per row), not {src.datatype} {src.shape}"
            )
        if isinstance(step, ImageStep):
            pixels = src.datatype == "UINT8" and len(src.shape) == 4
            if not (pixels or one_per_row):
                raise ValueError(
                    f"{where}: input '{step.input}' must be UINT8 [-1, H, W, C] pixels or "
                    f"BYTES [-1] encoded images, not {src.datatype} {src.shape}"
                )
            if pixels and src.shape[3] not in (-1, 1, 3, 4):
                raise ValueError(
                    f"{where}: input '{step.input}' has {src.shape[3]} channels; "
                    "expected 1 (gray), 3 (RGB) or 4 (RGBA)"
                )
        for name, value in step.produces().items():
            if name in produced or (name in client_in and name not in consumed):
                raise ValueError(f"{where}: tensor '{name}' is written twice")
            produced[name] = value
    for name, (datatype, shape) in produced.items():
        spec = engine_in.get(name)
        if spec is None:
            raise ValueError(
                f"processing.pre writes '{name}' but it is not in processing.engine_inputs "
                f"{sorted(engine_in)}"
            )
        if spec.datatype != datatype or not _shape_fits(spec.shape, shape):
            raise ValueError(
                f"processing.engine_inputs '{name}' is {spec.datatype} {spec.shape} but the "
                f"pre step writes {datatype} {shape}"
            )
    for name, spec in engine_in.items():
        if name in produced:
            continue
        src = client_in.get(name)
        if src is None or name in consumed:
            raise ValueError(
                f"engine input '{name}' is neither written by a pre step nor a model input "
                "passed through unchanged"
            )
        if src.datatype != spec.datatype or src.shape != spec.shape:
            raise ValueError(
                f"input '{name}' passes through to the engine but is {src.datatype} {src.shape} "
                f"for clients and {spec.datatype} {spec.shape} for the engine"
            )
    unused = sorted(set(client_in) - consumed - set(engine_in))
    if unused:
        raise ValueError(f"model input(s) {unused} are neither pre-processed nor engine inputs")
    tensors = {name: spec.datatype for name, spec in engine_out.items()}
    for post_step in proc.post:
        where = f"processing.post {post_step.kind} step"
        in_type = tensors.get(post_step.input)
        if in_type is None:
            raise ValueError(
                f"{where}: '{post_step.input}' is not an engine output or an earlier step's "
                f"output; available: {sorted(tensors)}"
            )
        if in_type not in ("FP16", "FP32", "FP64"):
            raise ValueError(f"{where}: '{post_step.input}' is {in_type}; it needs floating point")
        tensors.update(post_step.produces())
    topk_shapes = {
        name: [-1, step.k]
        for step in proc.post
        if isinstance(step, TopKStep)
        for name in step.produces()
    }
    for spec in config.outputs:
        if spec.name in topk_shapes and not _shape_fits(spec.shape, topk_shapes[spec.name]):
            raise ValueError(
                f"model output '{spec.name}' has shape {spec.shape} but top-k writes "
                f"{topk_shapes[spec.name]}"
            )
        out_type = tensors.get(spec.name)
        if out_type is None:
            raise ValueError(
                f"model output '{spec.name}' is neither an engine output nor written by a post "
                f"step; available: {sorted(tensors)}"
            )
        if out_type != spec.datatype:
            raise ValueError(
                f"model output '{spec.name}' is {spec.datatype} in outputs but {out_type} "
                "after processing"
            )
