"""Pre- and post-processing around the engine, run on the whole micro-batch.

A version's ``config.json`` may declare ``processing`` (see
`inferbus_common.processingconfig.ProcessingConfig`): pre steps turn what clients
send (texts, images) into what the engine takes (token ids, normalised FP32
pixels), post steps turn what the engine gives (logits) into what clients get
(probabilities, top-k labels and scores).

Why here, on the batch: the worker already holds the merged micro-batch as
numpy, so each step runs once for every row together (``encode_batch`` of
`tokenizers` is parallel Rust, the normalisation is one numpy expression)
instead of once per request in the gateway; and the gateway and batcher keep
handling bytes only.

A row whose pre-processing fails (an image that does not decode, text that is
not UTF-8) must fail its own request only: its rows are filled with zeros
(padding) so the batch keeps its shape, the engine computes them with the
rest, and the runner answers that request ``INVALID_ARGUMENT`` and drops its
rows' results.

Everything here is blocking CPU work, thread-safe, and run in the runner's
engine thread pool.
"""

from __future__ import annotations

import codecs
import io
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from inferbus_common.errors import FailedPrecondition
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.processingconfig import ImageStep, SoftmaxStep, TokenizeStep, TopKStep


class ProcessingError(FailedPrecondition):
    """A version's processing cannot be set up (bad tokenizer or labels file)."""


@dataclass(slots=True)
class PreResult:
    """Engine inputs of a micro-batch and the rows that could not be prepared.

    Attributes:
        inputs: engine inputs, every row present (failed rows zero-filled).
        row_errors: row index → what was wrong with it, for a person.
        seconds: time spent.
    """

    inputs: dict[str, np.ndarray]
    row_errors: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0


def _version_file(model_dir: Path, rel: str) -> Path:
    parts = PurePosixPath(rel)
    if parts.is_absolute() or ".." in parts.parts:
        raise ProcessingError(f"processing file {rel!r} is outside the version directory")
    path = model_dir.joinpath(*parts.parts)
    if not path.is_file():
        raise ProcessingError(f"processing file {rel!r} is missing from the version directory")
    return path


def load_labels(path: Path) -> np.ndarray:
    """A labels file as an object array of UTF-8 bytes: line i names class i.

    Trailing empty lines are ignored; an empty file is refused.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise ProcessingError(f"labels file {path.name} has no labels")
    out = np.empty(len(lines), dtype=object)
    out[:] = [line.strip().encode("utf-8") for line in lines]
    return out


# --- pre steps -------------------------------------------------------------------
class _Tokenize:
    """`TokenizeStep`: texts → ids (and mask), truncated and padded to max_length."""

    def __init__(self, step: TokenizeStep, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.step = step
        path = _version_file(model_dir, step.tokenizer)
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise ProcessingError(f"cannot load tokenizer {step.tokenizer}: {exc}") from exc
        # Configured once: encode_batch only reads the tokenizer, so threads may share it.
        tok.enable_truncation(max_length=step.max_length)
        tok.enable_padding(length=step.max_length, pad_id=step.pad_id)
        tok.encode_batch(["warm-up"])  # at load, so the first request does not pay for it
        self._tok = tok

    def __call__(self, values: np.ndarray, rows: int, errors: dict[int, str]) -> dict:
        texts: list[str] = []
        for i, raw in enumerate(values.reshape(rows)):
            try:
                # final=False: a text cut inside a character (the input's `truncate`
                # rule cuts bytes) loses that partial character instead of failing.
                texts.append(codecs.getincrementaldecoder("utf-8")().decode(bytes(raw)))
            except UnicodeDecodeError as exc:
                errors.setdefault(i, f"input '{self.step.input}' is not UTF-8 text: {exc}")
                texts.append("")
        encodings = self._tok.encode_batch(texts)
        n = self.step.max_length
        ids = np.zeros((rows, n), dtype=np.int64)
        mask = np.zeros((rows, n), dtype=np.int64)
        for i, enc in enumerate(encodings):
            if i in errors:
                ids[i] = self.step.pad_id
                continue
            ids[i] = enc.ids
            mask[i] = enc.attention_mask
        out = {self.step.ids: ids}
        if self.step.mask:
            out[self.step.mask] = mask
        return out


def _pil_mode(channels: int) -> str:
    return "L" if channels == 1 else "RGB"


class _Image:
    """`ImageStep`: pixels or encoded images → resized, normalised FP32."""

    def __init__(self, step: ImageStep) -> None:
        import PIL.Image  # noqa: F401  (imported at load, not on the first request)

        self.step = step
        c = step.channels
        self._mean = np.asarray(step.mean * (c if len(step.mean) == 1 else 1), np.float32)
        self._std = np.asarray(step.std * (c if len(step.std) == 1 else 1), np.float32)

    def _resize(self, image: Any) -> np.ndarray:
        from PIL import Image

        step = self.step
        image = image.convert(_pil_mode(step.channels))
        if image.size != (step.width, step.height):
            image = image.resize((step.width, step.height), Image.Resampling.BILINEAR)
        arr = np.asarray(image, dtype=np.uint8)
        return arr.reshape(step.height, step.width, step.channels)

    def _from_pixels(self, values: np.ndarray, errors: dict[int, str]) -> np.ndarray:
        from PIL import Image

        step = self.step
        rows, h, w, c = values.shape
        if (h, w, c) == (step.height, step.width, step.channels):
            return values  # already the right size: no per-image work at all
        out = np.zeros((rows, step.height, step.width, step.channels), dtype=np.uint8)
        mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(c)
        if mode is None:
            for i in range(rows):
                errors.setdefault(i, f"input '{step.input}' has {c} channels; expected 1, 3 or 4")
            return out
        for i in range(rows):
            pixels = values[i, :, :, 0] if c == 1 else values[i]
            out[i] = self._resize(Image.fromarray(np.ascontiguousarray(pixels), mode=mode))
        return out

    def _from_encoded(self, values: np.ndarray, rows: int, errors: dict[int, str]) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        step = self.step
        out = np.zeros((rows, step.height, step.width, step.channels), dtype=np.uint8)
        for i, raw in enumerate(values.reshape(rows)):
            try:
                with Image.open(io.BytesIO(bytes(raw))) as image:
                    image.load()
                    out[i] = self._resize(image)
            except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
                # PIL reports broken files with all of these, depending on the codec.
                errors.setdefault(i, f"input '{step.input}' is not a readable image: {exc}")
        return out

    def __call__(self, values: np.ndarray, rows: int, errors: dict[int, str]) -> dict:
        step = self.step
        if values.dtype == np.uint8:
            pixels = self._from_pixels(values, errors)
        else:
            pixels = self._from_encoded(values, rows, errors)
        x = pixels.astype(np.float32)
        x *= np.float32(step.scale)
        x -= self._mean
        x /= self._std
        for i in errors:
            x[i] = 0.0
        if step.layout == "NCHW":
            x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return {step.output: x}


# --- post steps ------------------------------------------------------------------
def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in FP32, shifted by the row maximum (no overflow)."""
    z = np.asarray(x, dtype=np.float32)
    z = z - z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices INT64, scores FP32) of the `k` largest values of each row, best first.

    Ties keep the lower class index first (a stable order), so answers are
    reproducible.
    """
    scores = np.asarray(x, dtype=np.float32).reshape(x.shape[0], -1)
    k = min(k, scores.shape[1])
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    return idx, np.take_along_axis(scores, idx, axis=1)


class _TopK:
    def __init__(self, step: TopKStep, model_dir: Path) -> None:
        self.step = step
        self.labels = load_labels(_version_file(model_dir, step.labels)) if step.labels else None

    def __call__(self, tensors: dict[str, np.ndarray]) -> None:
        step = self.step
        idx, scores = topk(tensors[step.input], step.k)
        tensors[step.scores] = scores
        if step.indices:
            tensors[step.indices] = idx
        if self.labels is not None:
            n = len(self.labels)
            # A class without a line in the labels file gets its index as label.
            safe = np.minimum(idx, n - 1)
            labels = self.labels[safe]
            over = idx >= n
            if over.any():
                labels[over] = [str(int(i)).encode() for i in idx[over]]
            tensors[step.labels_output] = labels


class Processing:
    """The pre and post steps of one version, loaded and ready to run.

    Args:
        config: the version's config (with a ``processing`` section).
        model_dir: the version's directory (tokenizer and labels files).

    Raises:
        ProcessingError: a referenced file is missing or unreadable.
    """

    def __init__(self, config: ModelConfig, model_dir: Path) -> None:
        proc = config.processing
        assert proc is not None
        self._pre: list[tuple[str, Any]] = []
        for step in proc.pre:
            if isinstance(step, TokenizeStep):
                self._pre.append((step.input, _Tokenize(step, model_dir)))
            elif isinstance(step, ImageStep):
                self._pre.append((step.input, _Image(step)))
        self._post: list[Any] = []
        for post in proc.post:
            if isinstance(post, SoftmaxStep):
                self._post.append(post)
            elif isinstance(post, TopKStep):
                self._post.append(_TopK(post, model_dir))
        self._engine_inputs = [s.name for s in config.engine_inputs()]
        self.engine_outputs = [s.name for s in config.engine_outputs()]
        """Outputs to ask the engine for."""
        self.outputs = [s.name for s in config.outputs]
        """Outputs clients may get."""
        self.has_pre = bool(self._pre)
        self.has_post = bool(self._post)

    def pre(self, inputs: Mapping[str, np.ndarray], rows: int) -> PreResult:
        """Engine inputs from the client inputs of a micro-batch of `rows` rows.

        Inputs no step consumes pass through unchanged (zero-copy).
        """
        t0 = time.perf_counter()
        errors: dict[int, str] = {}
        tensors: dict[str, np.ndarray] = {}
        consumed = set()
        for name, run in self._pre:
            tensors.update(run(inputs[name], rows, errors))
            consumed.add(name)
        for name, arr in inputs.items():
            if name not in consumed:
                tensors.setdefault(name, arr)
        engine_inputs = {name: tensors[name] for name in self._engine_inputs}
        return PreResult(engine_inputs, errors, time.perf_counter() - t0)

    def post(self, outputs: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        """Client outputs from the engine outputs; also the seconds spent."""
        t0 = time.perf_counter()
        tensors = dict(outputs)
        for step in self._post:
            if isinstance(step, SoftmaxStep):
                tensors[step.output or step.input] = softmax(tensors[step.input])
            else:
                step(tensors)
        out = {name: tensors[name] for name in self.outputs if name in tensors}
        return out, time.perf_counter() - t0


def build_processing(config: ModelConfig, model_dir: Path) -> Processing | None:
    """The version's `Processing`, or None when its config declares none.

    Raises:
        ProcessingError: a referenced file is missing or unreadable.
    """
    if config.processing is None:
        return None
    return Processing(config, model_dir)
