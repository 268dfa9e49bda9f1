"""Triton's ``image_client`` example against an NCHW and an NHWC image model.

A faithful re-implementation of the calls and checks of
``src/python/examples/image_client.py`` of Triton's client repository (CI
cannot fetch it; its code is not vendored): it reads the model metadata and
config, refuses a model whose input format is neither ``FORMAT_NCHW`` nor
``FORMAT_NHWC`` (before issue 30 every inferbus model said ``FORMAT_NONE``),
takes C, H and W from the input's shape in that order, pre-processes an
image with Pillow (convert, resize, transpose to CHW for NCHW), sends it
with the classification extension (``class_count``) and reads
``score:index:label`` strings, over gRPC (plain and streaming) and HTTP
(where the script wraps the JSON documents in attribute dictionaries).

The models are built here with `onnx.helper`: the mean of each colour
channel, then a fixed matrix to four classes (red, green, blue, dark), so a
red picture must come back as ``red``. The NCHW model's format is left out
of its config.json and completed at push from its shape; the NHWC model
declares it.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from PIL import Image
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from inferbus_testing.stack import LocalStack
from inferbus_testing.stringmodels import save_model

pytestmark = pytest.mark.integration

LABELS = ["red", "green", "blue", "dark"]
SIDE = 8
"""The models' image height and width."""

WEIGHTS = np.array(
    [[1.0, 0.0, 0.0, -1.0], [0.0, 1.0, 0.0, -1.0], [0.0, 0.0, 1.0, -1.0]], dtype=np.float32
)
"""Channel means → class scores (the last one: how dark the picture is)."""


def _write_image_model(
    out: Path, name: str, layout: str, *, declare: bool, side: int = SIDE
) -> Path:
    """An image classifier with input ``image`` (`side` × `side`) laid out as `layout`."""
    nchw = layout == "NCHW"
    shape = [-1, 3, side, side] if nchw else [-1, side, side, 3]
    nodes = [] if nchw else [helper.make_node("Transpose", ["image"], ["chw"], perm=[0, 3, 1, 2])]
    nodes += [
        helper.make_node("GlobalAveragePool", ["image" if nchw else "chw"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["means"], axis=1),
        helper.make_node("MatMul", ["means", "weights"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", *shape[1:]])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", len(LABELS)])],
        initializer=[
            helper.make_tensor("weights", TensorProto.FLOAT, [3, len(LABELS)], WEIGHTS.ravel())
        ],
    )
    image: dict[str, object] = {"name": "image", "datatype": "FP32", "shape": shape}
    if declare:
        image["format"] = f"FORMAT_{layout}"
    config = {
        "name": name,
        "max_batch_size": 4,
        "inputs": [image],
        "outputs": [
            {
                "name": "scores",
                "datatype": "FP32",
                "shape": [-1, len(LABELS)],
                "label_filename": "labels.txt",
            }
        ],
    }
    save_model(out, graph, config)
    (out / "labels.txt").write_text("\n".join(LABELS) + "\n")
    return out


MODELS = {"image_nchw": ("NCHW", False), "image_nhwc": ("NHWC", True)}
"""Model name → (layout, whether its config.json declares the format)."""


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A stack serving both image models."""
    base = tmp_path_factory.mktemp("image-client")
    stack = LocalStack(base, workers=1)
    with stack:
        for name, (layout, declare) in MODELS.items():
            stack.push(_write_image_model(base / name, name, layout, declare=declare), name)
        for name in MODELS:
            stack.wait_model_ready(name)
        yield stack


@pytest.fixture(scope="module")
def picture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A red picture larger than the models' input, so that it gets resized."""
    path = tmp_path_factory.mktemp("picture") / "red.png"
    pixels = np.zeros((32, 24, 3), dtype=np.uint8)
    pixels[..., 0] = 230
    pixels[..., 1:] = 20
    Image.fromarray(pixels, "RGB").save(path)
    return path


# --- the script's functions ------------------------------------------------------
def _attributes(doc: Any) -> Any:
    """JSON as attribute access (the script's ``AttrDict`` for HTTP documents)."""
    if isinstance(doc, dict):
        return SimpleNamespace(**{k: _attributes(v) for k, v in doc.items()})
    if isinstance(doc, list):
        return [_attributes(v) for v in doc]
    return doc


def _parse_model(model_metadata: Any, model_config: Any) -> tuple[Any, ...]:
    """The script's ``parse_model``: its checks, in its order, with its messages."""
    if len(model_metadata.inputs) != 1:
        raise Exception(f"expecting 1 input, got {len(model_metadata.inputs)}")
    if len(model_metadata.outputs) != 1:
        raise Exception(f"expecting 1 output, got {len(model_metadata.outputs)}")
    if len(model_config.input) != 1:
        raise Exception(f"expecting 1 input in model configuration, got {len(model_config.input)}")
    input_metadata = model_metadata.inputs[0]
    input_config = model_config.input[0]
    output_metadata = model_metadata.outputs[0]
    if output_metadata.datatype != "FP32":
        raise Exception(
            "expecting output datatype to be FP32, model '"
            + model_metadata.name
            + "' output type is "
            + output_metadata.datatype
        )
    # The output is a vector: every dimension but one (batch aside) is 1.
    output_batch_dim = model_config.max_batch_size > 0
    non_one_cnt = 0
    for dim in output_metadata.shape:
        if output_batch_dim:
            output_batch_dim = False
        elif dim > 1:
            non_one_cnt += 1
            if non_one_cnt > 1:
                raise Exception("expecting model output to be a vector")
    # The input has 3 dimensions besides the batch axis, CHW or HWC.
    input_batch_dim = model_config.max_batch_size > 0
    expected_input_dims = 3 + (1 if input_batch_dim else 0)
    if len(input_metadata.shape) != expected_input_dims:
        raise Exception(
            f"expecting input to have {expected_input_dims} dimensions, model '"
            f"{model_metadata.name}' input has {len(input_metadata.shape)}"
        )
    if isinstance(input_config.format, str):
        input_config.format = dict(mc.ModelInput.Format.items())[input_config.format]
    if input_config.format not in (mc.ModelInput.FORMAT_NCHW, mc.ModelInput.FORMAT_NHWC):
        raise Exception(
            "unexpected input format "
            + mc.ModelInput.Format.Name(input_config.format)
            + ", expecting "
            + mc.ModelInput.Format.Name(mc.ModelInput.FORMAT_NCHW)
            + " or "
            + mc.ModelInput.Format.Name(mc.ModelInput.FORMAT_NHWC)
        )
    first = 1 if input_batch_dim else 0
    if input_config.format == mc.ModelInput.FORMAT_NHWC:
        h, w, c = input_metadata.shape[first : first + 3]
    else:
        c, h, w = input_metadata.shape[first : first + 3]
    return (
        model_config.max_batch_size,
        input_metadata.name,
        output_metadata.name,
        c,
        h,
        w,
        input_config.format,
        input_metadata.datatype,
    )


def _preprocess(img: Image.Image, fmt: int, dtype: str, c: int, h: int, w: int) -> np.ndarray:
    """The script's ``preprocess`` with its default scaling (NONE)."""
    sample_img = img.convert("L") if c == 1 else img.convert("RGB")
    resized = np.array(sample_img.resize((w, h), Image.BILINEAR))
    if resized.ndim == 2:
        resized = resized[:, :, np.newaxis]
    scaled = resized.astype(triton_to_np_dtype(dtype))
    return np.transpose(scaled, (2, 0, 1)) if fmt == mc.ModelInput.FORMAT_NCHW else scaled


def _postprocess(
    results: Any, output_name: str, batch_size: int, supports_batching: bool
) -> list[list[str]]:
    """The script's ``postprocess``: each result's ``score:index:label`` fields."""
    output_array = results.as_numpy(output_name)
    if supports_batching and len(output_array) != batch_size:
        raise Exception(f"expected {batch_size} results, got {len(output_array)}")
    found = []
    for row in output_array:
        for result in row if supports_batching else [row]:
            if output_array.dtype.type == np.object_:
                cls = "".join(chr(x) for x in result).split(":")
            else:
                cls = result.split(":")
            found.append(cls)
    return found


def _model(client: Any, protocol: str, name: str) -> tuple[Any, Any]:
    model_metadata = client.get_model_metadata(model_name=name, model_version="")
    model_config = client.get_model_config(model_name=name, model_version="")
    if protocol == "grpc":
        return model_metadata, model_config.config
    return _attributes(model_metadata), _attributes(model_config)


# --- the runs ----------------------------------------------------------------------
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_image_client_classifies_a_picture(
    images: LocalStack, picture: Path, protocol: str, model: str
) -> None:
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(
        url=images.grpc_url if protocol == "grpc" else images.http_url
    )
    try:
        max_batch_size, input_name, output_name, c, h, w, fmt, dtype = _parse_model(
            *_model(client, protocol, model)
        )
        layout = MODELS[model][0]
        assert mc.ModelInput.Format.Name(fmt) == f"FORMAT_{layout}"
        assert (c, h, w) == (3, SIDE, SIDE)
        supports_batching = max_batch_size > 0
        batch_size = 2  # the script's -b: the picture repeated
        image_data = _preprocess(Image.open(picture), fmt, dtype, c, h, w)
        batched = np.stack([image_data] * batch_size, axis=0)
        inputs = [module.InferInput(input_name, batched.shape, dtype)]
        inputs[0].set_data_from_numpy(batched)
        outputs = [module.InferRequestedOutput(output_name, class_count=1)]
        response = client.infer(model, inputs, request_id="1", model_version="", outputs=outputs)
        this_id = (
            response.get_response().id if protocol == "grpc" else response.get_response()["id"]
        )
        assert this_id == "1"
        for score, index, label in _postprocess(
            response, output_name, batch_size, supports_batching
        ):
            assert (int(index), label) == (0, "red")
            assert float(score) > 150
    finally:
        client.close()


def test_image_client_streaming(images: LocalStack, picture: Path) -> None:
    """The script's ``--streaming`` (gRPC): the same request on a stream."""
    client = grpcclient.InferenceServerClient(url=images.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        max_batch_size, input_name, output_name, c, h, w, fmt, dtype = _parse_model(
            *_model(client, "grpc", "image_nhwc")
        )
        image_data = _preprocess(Image.open(picture), fmt, dtype, c, h, w)
        batched = np.stack([image_data], axis=0)
        inputs = [grpcclient.InferInput(input_name, batched.shape, dtype)]
        inputs[0].set_data_from_numpy(batched)
        outputs = [grpcclient.InferRequestedOutput(output_name, class_count=1)]
        client.start_stream(partial(lambda q, result, error: q.put((result, error)), answers))
        client.async_stream_infer("image_nhwc", inputs, request_id="1", outputs=outputs)
        result, error = answers.get(timeout=60)
        assert error is None
        ((_, index, label),) = _postprocess(result, output_name, 1, max_batch_size > 0)
        assert (int(index), label) == (0, "red")
    finally:
        client.stop_stream()
        client.close()


def test_a_model_without_an_image_format_is_refused_as_before(
    images: LocalStack, tmp_path: Path
) -> None:
    """The script's refusal still holds for an input whose format is not clear
    (``[3, 3, 3]``: channels first or last?), and the wording is Triton's."""
    name = "image_unclear"
    folder = tmp_path / name
    # 3×3 pictures of 3 channels: no telling whether they come first or last.
    _write_image_model(folder, name, "NCHW", declare=False, side=3)
    config = json.loads((folder / "config.json").read_text())
    assert "format" not in config["inputs"][0]
    images.push(folder, name)
    images.wait_model_ready(name)
    client = grpcclient.InferenceServerClient(url=images.grpc_url)
    try:
        with pytest.raises(Exception, match="unexpected input format FORMAT_NONE"):
            _parse_model(*_model(client, "grpc", name))
        # A version string that cannot name anything: Triton's code and wording.
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata(name, model_version="no/such")
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "failed to get model version from specified version string" in str(info.value)
    finally:
        client.close()
