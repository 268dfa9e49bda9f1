"""Small ONNX models with string (BYTES) tensors, built with `onnx.helper`, for tests.

* `write_identity_bytes`: ``IN`` BYTES ``[-1, -1]`` → ``OUT`` BYTES, the same
  strings back (any lengths, any number per row).
* `write_parse_int`: ``TEXT`` BYTES ``[-1, 1]`` → ``VALUE`` INT64 (the text
  parsed as a decimal integer by ONNX ``Cast``) and ``CANONICAL`` BYTES (that
  number written back as text, so ``"007"`` → ``"7"``). A text that is not an
  integer makes the model fail, every time.

Both batch (``max_batch_size`` 8) with a queue delay long enough for
concurrent requests to share a micro-batch. Each writer puts ``model.onnx``
and ``config.json`` into a folder ready for ``push``.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from inferbus_common.modelconfig import ModelConfig

OPSET = 17


def save_model(out: Path, graph: onnx.GraphProto, config: dict[str, object]) -> Path:
    """Check `graph` and `config`, write ``model.onnx`` and ``config.json`` into `out`."""
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="inferbus-tests"
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out / "model.onnx"))
    checked = ModelConfig.model_validate(config)
    (out / "config.json").write_text(checked.model_dump_json(indent=2) + "\n")
    return out


def _batching(max_batch_size: int, delay_us: int) -> dict[str, object]:
    return {"max_batch_size": max_batch_size, "batching": {"max_queue_delay_us": delay_us}}


def write_identity_bytes(
    out: Path, name: str = "strid", *, max_batch_size: int = 8, delay_us: int = 20_000
) -> Path:
    """Write the identity string model into `out` and return `out`."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["IN"], ["OUT"])],
        name,
        [helper.make_tensor_value_info("IN", TensorProto.STRING, ["batch", "n"])],
        [helper.make_tensor_value_info("OUT", TensorProto.STRING, ["batch", "n"])],
    )
    config = {
        "name": name,
        "inputs": [{"name": "IN", "datatype": "BYTES", "shape": [-1, -1]}],
        "outputs": [{"name": "OUT", "datatype": "BYTES", "shape": [-1, -1]}],
        **_batching(max_batch_size, delay_us),
    }
    return save_model(out, graph, config)


def write_parse_int(
    out: Path, name: str = "strint", *, max_batch_size: int = 8, delay_us: int = 20_000
) -> Path:
    """Write the string → integer model into `out` and return `out`."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["TEXT"], ["VALUE"], to=TensorProto.INT64),
            helper.make_node("Cast", ["VALUE"], ["CANONICAL"], to=TensorProto.STRING),
        ],
        name,
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", 1])],
        [
            helper.make_tensor_value_info("VALUE", TensorProto.INT64, ["batch", 1]),
            helper.make_tensor_value_info("CANONICAL", TensorProto.STRING, ["batch", 1]),
        ],
    )
    config = {
        "name": name,
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [
            {"name": "VALUE", "datatype": "INT64", "shape": [-1, 1]},
            {"name": "CANONICAL", "datatype": "BYTES", "shape": [-1, 1]},
        ],
        **_batching(max_batch_size, delay_us),
    }
    return save_model(out, graph, config)
