"""Documents of Triton's model configuration and statistics extensions.

`triton_config`: a version's `config.json` in the shape of Triton's model
configuration (gRPC ``ModelConfig``, REST ``GET
/v2/models/{m}[/versions/{v}]/config``), so Triton's tools read it:
`tritonclient`'s ``get_model_config`` and perf_analyzer, which sizes its
requests from ``max_batch_size`` and the inputs' ``dims``.

`triton_statistics`: one version's summed worker statistics
(`inferbus_common.modelstats`) as an entry of Triton's ``model_stats``
(gRPC ``ModelStatistics``, REST ``/v2/models[/{m}[/versions/{v}]]/stats``).

Both are built in their JSON form (Triton's HTTP answers: proto field names,
enum names, integers as JSON numbers); `to_proto` turns one into the gRPC
message, so both protocols say the same. The mapping is in
docs/architecture.md ("Triton's protocol extensions").
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from inferbus_common.catalog import DeployedVersion
from inferbus_common.datatypes import V2_TO_CONFIG
from inferbus_common.engineconfig import instance_device_kind
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.modelstats import Duration, ModelStats
from inferbus_common.sequencebatching import SequenceBatchingConfig, SequenceControl
from inferbus_common.tensorspec import TensorSpec

_BACKENDS = {
    "onnxruntime": "onnxruntime",
    "tensorrt": "tensorrt",
    "pytorch": "pytorch",
    "vllm": "vllm",
}
"""`EngineConfig.kind` → Triton backend name."""


def _dims(spec: TensorSpec, batched: bool) -> list[int]:
    """Triton's ``dims``: the shape without the batch axis when the model batches."""
    return list(spec.shape[1:] if batched else spec.shape)


def _input(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": V2_TO_CONFIG[spec.datatype],
        "format": spec.format or "FORMAT_NONE",
        "dims": _dims(spec, batched),
        "is_shape_tensor": False,
        "allow_ragged_batch": False,
        "optional": False,
    }


def _output(spec: TensorSpec, batched: bool, label_filename: str) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": V2_TO_CONFIG[spec.datatype],
        "dims": _dims(spec, batched),
        "label_filename": label_filename,
        "is_shape_tensor": False,
    }


def _instance_kind(config: ModelConfig) -> str:
    # A version that lists no 'cpu' provider never computes on the CPU: a worker
    # whose GPU provider does not start refuses it (FAILED_PRECONDITION).
    return "KIND_GPU" if instance_device_kind(config) == "gpu" else "KIND_CPU"


def _dynamic_batching(config: ModelConfig) -> dict[str, Any]:
    b = config.batching
    return {
        "preferred_batch_size": list(b.preferred_batch_sizes),
        "max_queue_delay_microseconds": b.max_queue_delay_us,
        "preserve_ordering": False,
        "priority_levels": b.priority_levels if b.priority_levels > 1 else 0,
        "default_priority_level": b.default_priority if b.priority_levels > 1 else 0,
        "default_queue_policy": {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": b.default_timeout_ms * 1000,
            "allow_timeout_override": True,
            "max_queue_size": b.max_queue_size,
        },
    }


_CONTROL_KINDS = {
    "start": "CONTROL_SEQUENCE_START",
    "ready": "CONTROL_SEQUENCE_READY",
    "end": "CONTROL_SEQUENCE_END",
    "corrid": "CONTROL_SEQUENCE_CORRID",
}


def _control(c: SequenceControl) -> dict[str, Any]:
    control: dict[str, Any] = {"kind": _CONTROL_KINDS[c.kind]}
    if c.kind == "corrid":
        control["data_type"] = V2_TO_CONFIG[c.datatype]
    elif c.datatype == "INT32":
        control["int32_false_true"] = [int(v) for v in c.false_true]
    elif c.datatype == "FP32":
        control["fp32_false_true"] = list(c.false_true)
    else:
        control["bool_false_true"] = [bool(v) for v in c.false_true]
    return {"name": c.name, "control": [control]}


def _sequence_batching(seq: SequenceBatchingConfig) -> dict[str, Any]:
    return {
        "max_sequence_idle_microseconds": seq.max_sequence_idle_us,
        "control_input": [_control(c) for c in seq.controls],
        "state": [
            {
                "input_name": s.input,
                "output_name": s.output,
                "data_type": V2_TO_CONFIG[s.datatype],
                "dims": list(s.shape),
                "initial_state": [
                    {
                        "data_type": V2_TO_CONFIG[s.datatype],
                        "dims": list(s.shape),
                        "zero_data": True,
                        "name": f"{s.input}_initial",
                    }
                ],
            }
            for s in seq.states
        ],
        "oldest": {
            "max_candidate_sequences": seq.max_sequences,
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": seq.max_queue_delay_us,
            "preserve_ordering": False,
        },
    }


def triton_config(name: str, dv: DeployedVersion) -> dict[str, Any]:
    """The Triton-shaped configuration of a deployed version, as JSON.

    Args:
        name: the model name the client asked for.
        dv: the version.

    The tensors are the ones clients send and get (with pre/post-processing,
    not the engine's). ``instance_group.count`` is per worker: each worker of
    the version's pool runs that many executions at once.
    """
    config = dv.config
    group = config.instance_group
    batched = config.max_batch_size > 0
    doc: dict[str, Any] = {
        "name": name,
        "platform": config.platform,
        "backend": _BACKENDS[config.engine.kind],
        "max_batch_size": config.max_batch_size,
        "input": [_input(s, batched) for s in config.inputs],
        "output": [_output(s, batched, s.label_filename or "") for s in config.outputs],
        "instance_group": [
            {
                "name": f"{name}_0",
                "kind": _instance_kind(config),
                # Triton's count is per GPU listed (config.instance_count is the total).
                "count": group.count if group is not None else config.instance_count,
                "gpus": list(group.gpus) if group is not None else [],
                "profile": [],
                "passive": False,
                "host_policy": "",
            }
        ],
        "default_model_filename": config.file,
        "parameters": {
            "inferbus_version": {"string_value": dv.version},
            "inferbus_pool": {"string_value": config.pool},
            "inferbus_digest": {"string_value": dv.digest},
        },
        "model_transaction_policy": {"decoupled": config.is_decoupled},
    }
    if config.sequence_batching is not None:
        # Triton's scheduling_choice: a sequence model has no dynamic batcher.
        doc["sequence_batching"] = _sequence_batching(config.sequence_batching)
    elif batched:
        doc["dynamic_batching"] = _dynamic_batching(config)
    return doc


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def triton_statistics(name: str, version: str, stats: ModelStats) -> dict[str, Any]:
    """One entry of Triton's ``model_stats`` from a version's (summed) statistics."""
    return {
        "name": name,
        "version": version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {
            "success": _duration(stats.success),
            "fail": _duration(stats.fail),
            "queue": _duration(stats.queue),
            "compute_input": _duration(stats.compute_input),
            "compute_infer": _duration(stats.compute_infer),
            "compute_output": _duration(stats.compute_output),
            # No response cache: nothing is ever a hit or a miss.
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": {"count": values[0], "ns": values[1]},
                "compute_infer": {"count": values[0], "ns": values[2]},
                "compute_output": {"count": values[0], "ns": values[3]},
            }
            for size, values in sorted(stats.batches.items())
            if len(values) >= 4
        ],
    }


_M = TypeVar("_M", bound=Message)


def to_proto(doc: dict[str, Any], message: _M) -> _M:
    """Fill `message` (e.g. ``inference.ModelConfig``) from its JSON form and return it."""
    return json_format.ParseDict(doc, message)
