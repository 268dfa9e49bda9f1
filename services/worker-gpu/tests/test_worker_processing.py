"""Pre/post-processing on the batch (`inferbus_worker.processing`).

Each step is compared with an independent reference: images with PIL decoding
and resizing plus the normalisation written out in float64, texts with the
`tokenizers` library used directly, softmax/top-k with plain numpy. The last
tests run a `ModelRunner` with processing on a real nats-server: one
undecodable image fails its own request only, and the replies carry ``pre``
and ``post`` stage timings.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import io
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import nats
import numpy as np
import onnx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from onnx import TensorProto, helper, numpy_helper
from PIL import Image
from prometheus_client import REGISTRY
from tokenizers import Tokenizer

from inferbus_common.bus import ensure_batch_stream
from inferbus_common.catalog import DeployedVersion
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.processingconfig import ImageStep
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.microbatch import BatchEntry, encode_joined_batch
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects
from inferbus_testing.answers import Answer, answers_of
from inferbus_worker.engines import OnnxRuntimeEngine
from inferbus_worker.processing import Processing, ProcessingError, build_processing, softmax, topk
from inferbus_worker.runner import ModelRunner
from inferbus_worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[3]


def _load_textcls() -> ModuleType:
    path = REPO / "examples" / "textcls" / "make_model.py"
    spec = importlib.util.spec_from_file_location("inferbus_example_textcls", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def textcls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example text classifier, built by its own script."""
    out = tmp_path_factory.mktemp("textcls")
    _load_textcls().write_model(out)
    return out


# --- images ------------------------------------------------------------------------
def image_config(source: dict[str, object], **step: object) -> ModelConfig:
    """A model taking images (`source` is the client input spec) and FP32 pixels."""
    full = {"kind": "image", "input": "image", "output": "pixels", **step}
    # The engine input's shape follows the step (layout, size, channels).
    shape = ImageStep.model_validate(full).output_shape()
    return ModelConfig.model_validate(
        {
            "name": "img",
            "inputs": [{"name": "image", **source}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}],
            "processing": {
                "pre": [full],
                "engine_inputs": [{"name": "pixels", "datatype": "FP32", "shape": shape}],
            },
        }
    )


def reference_pixels(
    images: list[Image.Image],
    *,
    height: int,
    width: int,
    channels: int = 3,
    scale: float = 1 / 255,
    mean: tuple[float, ...] = (0.0,),
    std: tuple[float, ...] = (1.0,),
    layout: str = "NCHW",
) -> np.ndarray:
    """PIL resize, then ``(x * scale - mean) / std`` in float64, then the layout."""
    out = []
    for image in images:
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        a = np.asarray(image, dtype=np.float64).reshape(height, width, channels)
        a = (a * scale - np.asarray(mean, np.float64)) / np.asarray(std, np.float64)
        out.append(a.transpose(2, 0, 1) if layout == "NCHW" else a)
    return np.stack(out)


def random_images(n: int, h: int, w: int, c: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, c), dtype=np.uint8)


def to_pil(arr: np.ndarray) -> Image.Image:
    if arr.shape[-1] == 1:
        return Image.fromarray(arr[:, :, 0], mode="L")
    return Image.fromarray(arr, mode="RGBA" if arr.shape[-1] == 4 else "RGB")


@pytest.mark.parametrize(
    ("src", "step"),
    [
        # Already the right size: the vectorised path, no resizing.
        ((8, 8, 3), {"height": 8, "width": 8}),
        # Resized, ImageNet normalisation, channels last.
        (
            (10, 7, 3),
            {
                "height": 6,
                "width": 5,
                "mean": [0.485, 0.456, 0.406],
                "std": [0.229, 0.224, 0.225],
                "layout": "NHWC",
            },
        ),
        # Colour to grayscale, one mean/std for the channel.
        ((9, 9, 3), {"height": 4, "width": 4, "channels": 1, "mean": [0.5], "std": [0.5]}),
        # RGBA pixels: alpha dropped.
        ((5, 6, 4), {"height": 5, "width": 6, "scale": 1.0}),
        # Gray pixels to RGB, upscaled.
        ((3, 3, 1), {"height": 7, "width": 7}),
    ],
)
def test_image_pixels_match_pil_reference(
    tmp_path: Path, src: tuple[int, int, int], step: dict[str, object]
) -> None:
    config = image_config({"datatype": "UINT8", "shape": [-1, -1, -1, -1]}, **step)
    proc = Processing(config, tmp_path)
    pixels = random_images(4, *src, seed=sum(src))
    result = proc.pre({"image": pixels}, 4)
    assert result.row_errors == {}
    got = result.inputs["pixels"]
    assert got.dtype == np.float32
    assert got.flags.c_contiguous
    want = reference_pixels(
        [to_pil(p) for p in pixels],
        **{k: tuple(v) if isinstance(v, list) else v for k, v in step.items()},  # type: ignore[arg-type]
    )
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _encode(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    to_pil(arr).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_encoded_images_match_pil_decoding(tmp_path: Path, fmt: str) -> None:
    config = image_config(
        {"datatype": "BYTES", "shape": [-1]}, height=12, width=16, mean=[0.5], std=[0.25]
    )
    proc = Processing(config, tmp_path)
    sources = random_images(3, 20, 24, 3, seed=7)
    blobs = [_encode(a, fmt) for a in sources]
    values = np.empty(3, dtype=object)
    values[:] = blobs
    result = proc.pre({"image": values}, 3)
    assert result.row_errors == {}
    want = reference_pixels(
        [Image.open(io.BytesIO(b)) for b in blobs], height=12, width=16, mean=(0.5,), std=(0.25,)
    )
    np.testing.assert_allclose(result.inputs["pixels"], want, rtol=1e-5, atol=1e-5)


def test_undecodable_image_fails_only_its_row(tmp_path: Path) -> None:
    config = image_config({"datatype": "BYTES", "shape": [-1, 1]}, height=4, width=4)
    proc = Processing(config, tmp_path)
    good = random_images(2, 6, 6, 3, seed=3)
    blobs = [_encode(good[0], "PNG"), b"this is not an image", _encode(good[1], "PNG")[:40]]
    blobs.append(_encode(good[1], "PNG"))
    values = np.empty((4, 1), dtype=object)
    values[:, 0] = blobs
    result = proc.pre({"image": values}, 4)
    # Row 1 is garbage, row 2 a truncated PNG: both fail alone.
    assert sorted(result.row_errors) == [1, 2]
    assert "not a readable image" in result.row_errors[1]
    got = result.inputs["pixels"]
    assert got.shape == (4, 3, 4, 4)
    want = reference_pixels([to_pil(good[0]), to_pil(good[1])], height=4, width=4)
    np.testing.assert_allclose(got[[0, 3]], want, rtol=1e-5, atol=1e-5)
    assert not got[[1, 2]].any()


# --- texts ---------------------------------------------------------------------------
def test_tokenize_matches_tokenizers_library(textcls_dir: Path) -> None:
    config = ModelConfig.model_validate_json((textcls_dir / "config.json").read_text())
    proc = build_processing(config, textcls_dir)
    assert proc is not None
    texts = [
        "The service was excellent",
        "",
        "word " * 100,  # longer than max_length: truncated
        "caf\u00e9 \u2603 unseen-words xyzzy",
    ]
    values = np.empty((4, 1), dtype=object)
    values[:, 0] = [t.encode() for t in texts]
    result = proc.pre({"text": values}, 4)
    assert result.row_errors == {}
    tok = Tokenizer.from_file(str(textcls_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=32)
    tok.enable_padding(length=32, pad_id=0)
    encodings = tok.encode_batch(texts)
    np.testing.assert_array_equal(result.inputs["input_ids"], [e.ids for e in encodings])
    np.testing.assert_array_equal(
        result.inputs["attention_mask"], [e.attention_mask for e in encodings]
    )
    assert result.inputs["input_ids"].dtype == np.int64
    assert result.inputs["attention_mask"][2].sum() == 32
    assert result.inputs["attention_mask"][1].sum() == 0


def test_text_that_is_not_utf8_fails_only_its_row(textcls_dir: Path) -> None:
    config = ModelConfig.model_validate_json((textcls_dir / "config.json").read_text())
    proc = Processing(config, textcls_dir)
    values = np.empty(3, dtype=object)
    # Row 2 was cut inside a character (as `truncate` does): the partial character is dropped.
    values[:] = [b"great value", b"\xff\xfe broken", "caf\u00e9".encode()[:4]]
    result = proc.pre({"text": values}, 3)
    assert list(result.row_errors) == [1]
    assert "not UTF-8" in result.row_errors[1]
    tok = Tokenizer.from_file(str(textcls_dir / "tokenizer.json"))
    ids = tok.encode("caf").ids
    assert result.inputs["input_ids"][2].tolist() == ids + [0] * (32 - len(ids))


# --- post steps ------------------------------------------------------------------------
def test_softmax_matches_reference_and_does_not_overflow() -> None:
    x = np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, -1000.0], [-5.0, 0.0, 5.0]], np.float32)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    got = softmax(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.isfinite(got).all()


def test_topk_orders_best_first_and_ties_by_index() -> None:
    x = np.array([[0.1, 0.7, 0.2, 0.7], [0.4, 0.3, 0.2, 0.1]], np.float32)
    idx, scores = topk(x, 3)
    np.testing.assert_array_equal(idx, [[1, 3, 2], [0, 1, 2]])
    np.testing.assert_allclose(scores, [[0.7, 0.7, 0.2], [0.4, 0.3, 0.2]])
    assert idx.dtype == np.int64


def post_config(labels: str | None, k: int, classes: int = 4) -> ModelConfig:
    outputs = [{"name": "score", "datatype": "FP32", "shape": [-1, k]}]
    if labels:
        outputs.append({"name": "label", "datatype": "BYTES", "shape": [-1, k]})
    return ModelConfig.model_validate(
        {
            "name": "post",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [*outputs, {"name": "idx", "datatype": "INT64", "shape": [-1, k]}],
            "processing": {
                "post": [
                    {"kind": "softmax", "input": "logits"},
                    {"kind": "topk", "input": "logits", "k": k, "labels": labels, "indices": "idx"},
                ],
                "engine_outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, classes]}],
            },
        }
    )


def test_post_softmax_then_topk_with_labels(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("cat\ndog\nbird\n\n")  # 3 labels, 4 classes
    proc = Processing(post_config("labels.txt", 2), tmp_path)
    logits = np.array([[0.0, 3.0, 1.0, 0.5], [2.0, 0.0, 0.0, 4.0]], np.float32)
    out, seconds = proc.post({"logits": logits})
    assert seconds >= 0
    assert set(out) == {"score", "label", "idx"}
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_array_equal(out["idx"], [[1, 2], [3, 0]])
    np.testing.assert_allclose(
        out["score"], [[probs[0, 1], probs[0, 2]], [probs[1, 3], probs[1, 0]]]
    )
    # Class 3 has no line in the labels file: its index stands in for the label.
    assert out["label"].tolist() == [[b"dog", b"bird"], [b"3", b"cat"]]


def test_missing_processing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProcessingError, match=r"'labels\.txt' is missing"):
        Processing(post_config("labels.txt", 1), tmp_path)
    (tmp_path / "labels.txt").write_text("\n")
    with pytest.raises(ProcessingError, match="no labels"):
        Processing(post_config("labels.txt", 1), tmp_path)


# --- the runner on a real nats-server -----------------------------------------------------
COLOURS = ["red", "green", "blue"]


def write_colour_model(out: Path) -> ModelConfig:
    """A model that scores an image's mean red, green and blue: PNG in, colour label out."""
    out.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["pixels"], ["m"], axes=[2, 3], keepdims=0),
            helper.make_node("Mul", ["m", "gain"], ["logits"]),
        ],
        "colour",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(np.array(8.0, np.float32), "gain")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(out / "model.onnx"))
    (out / "labels.txt").write_text("\n".join(COLOURS) + "\n")
    config = ModelConfig.model_validate(
        {
            "name": "colour",
            "max_batch_size": 8,
            "inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}],
            "outputs": [
                {"name": "label", "datatype": "BYTES", "shape": [-1, 1]},
                {"name": "score", "datatype": "FP32", "shape": [-1, 1]},
            ],
            "processing": {
                "pre": [
                    {"kind": "image", "input": "image", "output": "pixels", "height": 4, "width": 4}
                ],
                "post": [
                    {"kind": "softmax", "input": "logits"},
                    {"kind": "topk", "input": "logits", "k": 1},
                ],
                "engine_inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 4, 4]}],
                "engine_outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}],
            },
        }
    )
    (out / "config.json").write_text(config.model_dump_json())
    return config


def solid_png(rgb: tuple[int, int, int], size: int = 9) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": "colour", "version": "1", **labels}) or 0.0


@pytest.mark.integration
async def test_runner_runs_pre_and_post_and_fails_bad_rows_alone(
    nc: Client, tmp_path: Path
) -> None:
    config = write_colour_model(tmp_path)
    files = {
        name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        for name in ("model.onnx", "labels.txt", "config.json")
    }
    dv = DeployedVersion(model="colour", version="1", config=config, digest="d", files=files)
    subjects = Subjects("tproc")
    js = nc.jetstream()
    await ensure_batch_stream(js, subjects)
    settings = WorkerSettings(
        nats_url="nats://unused", subject_prefix=subjects.prefix, fetch_timeout_s=0.2
    )
    engine = OnnxRuntimeEngine(tmp_path / "model.onnx", config.engine)
    engine.load()
    pre_before = _sample("inferbus_worker_processing_seconds_count", stage="pre")
    runner = ModelRunner(
        nc, js, subjects, settings, dv, engine, processing=build_processing(config, tmp_path)
    )
    await runner.start()
    replies: dict[str, Answer] = {}

    async def on_reply(msg: Msg) -> None:
        replies[msg.subject.rsplit(".", 1)[1]] = answers_of(msg)[0]

    await nc.subscribe(f"rp.{subjects.prefix}.*", cb=on_reply)
    try:
        images = {
            "red": [solid_png((250, 10, 10))],
            "bad": [b"\x89PNG but not really"],
            "pair": [solid_png((10, 10, 240)), solid_png((20, 230, 20), size=3)],
        }
        entries, blobs = [], []
        deadline = h.deadline_from_timeout(30)
        for rid, rows in images.items():
            entries.append(BatchEntry(rid, f"rp.{subjects.prefix}.{rid}", deadline, 0, len(rows)))
            blobs += rows
        values = np.empty((len(blobs), 1), dtype=object)
        values[:, 0] = blobs
        data = encode_joined_batch(entries, [[tensor_from_numpy("image", values)]])
        await js.publish(subjects.batch("default", "colour", "1"), data)
        end = time.monotonic() + 20
        while len(replies) < 3:
            assert time.monotonic() < end, f"replies: {sorted(replies)}"
            await asyncio.sleep(0.01)
        bad = replies["bad"]
        assert bad.headers[h.STATUS] == "INVALID_ARGUMENT"
        assert "row 0" in bad.headers[h.ERROR]
        assert "not a readable image" in bad.headers[h.ERROR]
        for rid, want in (("red", [b"red"]), ("pair", [b"blue", b"green"])):
            msg = replies[rid]
            assert h.STATUS not in (msg.headers or {}), msg.headers
            out = {t.name: t.as_numpy() for t in decode_tensors(msg.data)}
            assert out["label"].reshape(-1).tolist() == want
            assert out["score"].shape == (len(want), 1)
            assert (out["score"] > 1 / 3).all()
            timings = h.parse_timings(msg.headers[h.TIMINGS])
            assert {"queue", "pre", "compute", "post"} <= set(timings)
            assert timings["pre"] > 0 and timings["post"] > 0
            # One execution for the batch; the answered requests hold 3 of its rows.
            assert msg.headers[h.BATCH_SIZE] == "3"
        assert _sample("inferbus_worker_processing_seconds_count", stage="pre") == pre_before + 1
    finally:
        await runner.stop()
