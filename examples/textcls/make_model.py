"""Build the example text classifier: tokenizer, ONNX model, labels and config.json.

Everything is made here from fixed inputs (nothing is downloaded): a BPE
tokenizer trained with `tokenizers` on a small built-in corpus, and an
embedding-bag classifier in ONNX with random but seeded weights::

    text ─(worker pre: tokenize)─▶ input_ids, attention_mask INT64 [-1, 32]
         ─(engine)─▶ Gather embeddings → masked mean over tokens → Gemm → logits FP32 [-1, 3]
         ─(worker post: softmax, top-1 with labels.txt)─▶ label BYTES [-1, 1], score FP32 [-1, 1]

Clients send text and get a label; the engine only ever sees token ids. The
weights are random, so the labels are not meaningful; what matters is that
the platform's answer equals tokenizer + onnxruntime + softmax run directly.

Usage::

    uv run python examples/textcls/make_model.py [--out examples/textcls/model]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from inferbus_common.modelconfig import ModelConfig

SEED = 20261203
"""Seed of the weights: fixed so the model (and its digest) never changes."""
DEFAULT_OUT = Path(__file__).resolve().parent / "model"
OPSET = 17
MAX_LENGTH = 32
EMBED_DIM = 16
LABELS = ["negative", "neutral", "positive"]
PAD, UNK = "[PAD]", "[UNK]"

CORPUS = [
    "the service was excellent and the staff were friendly",
    "terrible experience, the order arrived late and broken",
    "it was fine, nothing special about it",
    "i love this product, it works perfectly",
    "worst purchase ever, i want a refund",
    "the package arrived on tuesday",
    "great value for the price and fast delivery",
    "the screen cracked after two days of use",
    "average quality, does what it says",
    "absolutely wonderful support team, thank you",
    "the app keeps crashing and support never answers",
    "delivery took a week as announced",
    "happy with the result, would buy again",
    "disappointed by the poor battery life",
    "the manual explains the setup in three steps",
]
"""Training text of the tokenizer (its vocabulary comes from these words)."""


def train_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A lower-casing BPE tokenizer trained on `CORPUS`; ``[PAD]`` is id 0, ``[UNK]`` id 1."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, UNK], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def build_classifier(vocab: int, classes: int, *, seed: int = SEED) -> onnx.ModelProto:
    """Embedding-bag + linear classifier over token ids.

    ``logits = mean(E[ids] over tokens where mask == 1) @ W + b``; an all-pad
    row divides by 1, not 0.
    """
    rng = np.random.default_rng(seed)
    emb = rng.normal(0.0, 1.0, size=(vocab, EMBED_DIM)).astype(np.float32)
    w = rng.normal(0.0, np.sqrt(2.0 / EMBED_DIM), size=(EMBED_DIM, classes)).astype(np.float32)
    b = rng.normal(0.0, 0.01, size=(classes,)).astype(np.float32)
    inits = [
        numpy_helper.from_array(emb, "embeddings"),
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    nodes = [
        helper.make_node("Gather", ["embeddings", "input_ids"], ["tokens"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["tokens", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["maskf", "axis1"], ["count"], keepdims=1),
        helper.make_node("Max", ["count", "one"], ["count1"]),
        helper.make_node("Div", ["summed", "count1"], ["pooled"]),
        helper.make_node("Gemm", ["pooled", "w", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "textcls",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", MAX_LENGTH]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", MAX_LENGTH]
            ),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="inferbus-examples"
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def model_config(name: str = "textcls", classes: int = len(LABELS)) -> ModelConfig:
    """The `config.json`: text in, label and score out, the engine in between."""
    return ModelConfig.model_validate(
        {
            "name": name,
            "platform": "onnxruntime_onnx",
            "file": "model.onnx",
            "max_batch_size": 32,
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [-1, 1],
                    "max_element_bytes": 4096,
                    "truncate": True,
                }
            ],
            "outputs": [
                {"name": "label", "datatype": "BYTES", "shape": [-1, 1]},
                {"name": "score", "datatype": "FP32", "shape": [-1, 1]},
                {"name": "probabilities", "datatype": "FP32", "shape": [-1, classes]},
            ],
            "batching": {"max_queue_delay_us": 500},
            "processing": {
                "pre": [
                    {
                        "kind": "tokenize",
                        "input": "text",
                        "tokenizer": "tokenizer.json",
                        "max_length": MAX_LENGTH,
                        "ids": "input_ids",
                        "mask": "attention_mask",
                        "pad_id": 0,
                    }
                ],
                "post": [
                    {"kind": "softmax", "input": "logits", "output": "probabilities"},
                    {
                        "kind": "topk",
                        "input": "probabilities",
                        "k": 1,
                        "labels": "labels.txt",
                        "labels_output": "label",
                        "scores": "score",
                    },
                ],
                "engine_inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [-1, MAX_LENGTH]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [-1, MAX_LENGTH]},
                ],
                "engine_outputs": [
                    {"name": "logits", "datatype": "FP32", "shape": [-1, classes]},
                ],
            },
        }
    )


def write_model(out: Path) -> dict[str, object]:
    """Write ``tokenizer.json``, ``model.onnx``, ``labels.txt`` and ``config.json`` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    config = model_config()
    onnx.save_model(build_classifier(tok.get_vocab_size(), len(LABELS)), str(out / config.file))
    (out / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (out / "config.json").write_text(config.model_dump_json(indent=2, exclude_none=True) + "\n")
    # Generated artifacts never belong in git.
    (out / ".gitignore").write_text("*\n")
    return {
        "out": str(out),
        "model": config.name,
        "vocab_size": tok.get_vocab_size(),
        "files": ["tokenizer.json", "model.onnx", "labels.txt", "config.json"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Write the text classifier into ``--out``."""
    parser = argparse.ArgumentParser(description="Build the example text classifier.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    out = parser.parse_args(argv).out
    print(json.dumps(write_model(out)))


if __name__ == "__main__":
    main()
