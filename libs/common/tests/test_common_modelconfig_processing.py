"""The ``processing`` section of config.json: known steps, tensors that fit together."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from inferbus_common.modelconfig import ModelConfig
from inferbus_common.processingconfig import TokenizeStep, TopKStep


def text_config() -> dict[str, Any]:
    """Text in, label/score out; the engine takes ids and gives logits."""
    return {
        "name": "textcls",
        "max_batch_size": 16,
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [-1, 2]},
            {"name": "score", "datatype": "FP32", "shape": [-1, 2]},
        ],
        "processing": {
            "pre": [{"kind": "tokenize", "input": "text", "max_length": 8}],
            "post": [
                {"kind": "softmax", "input": "logits", "output": "probabilities"},
                {"kind": "topk", "input": "probabilities", "k": 2},
            ],
            "engine_inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [-1, 8]},
                {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]},
            ],
            "engine_outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}],
        },
    }


def test_valid_processing_and_engine_view() -> None:
    config = ModelConfig.model_validate(text_config())
    assert config.processing is not None
    assert isinstance(config.processing.pre[0], TokenizeStep)
    assert isinstance(config.processing.post[1], TopKStep)
    assert config.processing.files() == ["labels.txt", "tokenizer.json"]
    view = config.engine_view()
    assert [s.name for s in view.inputs] == ["input_ids", "attention_mask"]
    assert [s.name for s in view.outputs] == ["logits"]
    assert view.processing is None
    # Clients still see (and are validated against) text in, label/score out.
    assert [s.name for s in config.inputs] == ["text"]
    # Round trip through JSON (what the registry stores) keeps the section.
    again = ModelConfig.model_validate_json(config.model_dump_json())
    assert again == config


def test_no_processing_engine_tensors_are_the_model_tensors() -> None:
    config = ModelConfig.model_validate(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        }
    )
    assert config.engine_inputs() == config.inputs
    assert config.engine_outputs() == config.outputs
    assert config.engine_view() is config
    # Absent, the section is left out of dumps: canonical config.json bytes (and
    # digests) stay what they were before the section existed.
    assert "processing" not in config.model_dump(mode="json")
    assert '"processing"' not in config.model_dump_json()
    # Same for every field added since the first release, at its default.
    first_release = {
        "name", "platform", "file", "max_batch_size", "inputs", "outputs", "engine",
        "batching", "instance_count", "pool", "fallback",
    }  # fmt: skip
    assert set(config.model_dump(mode="json")) == first_release
    lazy = config.model_copy(update={"load_policy": "lazy", "slo_p99_ms": 50.0})
    assert {"load_policy", "slo_p99_ms"} <= set(lazy.model_dump(mode="json"))


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("processing.pre.0.kind", "resize", "does not match any of the expected tags"),
        ("processing.post.0.kind", "argmax", "does not match any of the expected tags"),
        ("processing.engine_inputs", _DELETE, "processing.pre needs processing.engine_inputs"),
        ("processing.engine_outputs", _DELETE, "processing.post needs processing.engine_outputs"),
        ("max_batch_size", 0, "need max_batch_size > 0"),
        (
            "inputs.0",
            {"name": "text", "datatype": "FP32", "shape": [-1, 1]},
            "must be BYTES with shape",
        ),
        ("processing.pre.0.input", "prompt", "'prompt' is not a model input"),
        (
            "processing.engine_inputs.0",
            {"name": "input_ids", "datatype": "INT32", "shape": [-1, 8]},
            "'input_ids' is INT32 .* pre step writes INT64",
        ),
        (
            "processing.engine_inputs.0",
            {"name": "input_ids", "datatype": "INT64", "shape": [-1, 16]},
            r"pre step writes INT64 \[-1, 8\]",
        ),
        ("processing.pre.0.mask", None, "'attention_mask' is neither written by a pre step"),
        ("processing.pre.0.ids", "ids", "writes 'ids' but it is not in processing.engine_inputs"),
        ("processing.post.1.input", "nope", "'nope' is not an engine output"),
        ("processing.post.1.k", 3, r"top-k writes \[-1, 3\]"),
        ("outputs.1.datatype", "FP64", "'score' is FP64 in outputs but FP32 after processing"),
        (
            "processing.engine_outputs.0",
            {"name": "logits", "datatype": "INT64", "shape": [-1, 3]},
            "needs floating point",
        ),
        ("processing.post.1.labels", None, "'label' is neither an engine output nor written"),
    ],
)
def test_inconsistent_processing_is_refused(path: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig.model_validate(_set(text_config(), path, value))


def image_doc(**step: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "image", "datatype": "UINT8", "shape": [-1, -1, -1, 3]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
        "processing": {
            "pre": [
                {"kind": "image", "input": "image", "output": "image", "height": 8, "width": 8}
                | step
            ],
            "engine_inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 8, 8]}],
        },
    }


def test_image_step_may_reuse_the_input_name() -> None:
    config = ModelConfig.model_validate(image_doc())
    assert config.engine_inputs()[0].datatype == "FP32"


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({"layout": "NHWC"}, r"pre step writes FP32 \[-1, 8, 8, 3\]"),
        ({"mean": [0.1, 0.2]}, "mean needs 1 or 3 values"),
        ({"std": [0.0]}, "std must not contain 0"),
        ({"channels": 2}, "channels"),
    ],
)
def test_bad_image_steps_are_refused(step: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig.model_validate(image_doc(**step))


def test_unprocessed_input_must_pass_through() -> None:
    doc = text_config()
    doc["inputs"].append({"name": "extra", "datatype": "FP32", "shape": [-1, 2]})
    with pytest.raises(ValidationError, match=r"\['extra'\] are neither pre-processed"):
        ModelConfig.model_validate(doc)
    doc["processing"]["engine_inputs"].append(
        {"name": "extra", "datatype": "FP32", "shape": [-1, 2]}
    )
    config = ModelConfig.model_validate(doc)
    assert [s.name for s in config.engine_inputs()][-1] == "extra"
