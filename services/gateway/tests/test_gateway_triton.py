"""Triton-shaped model configuration and statistics documents, and their wire form.

The gRPC answers must decode with Triton's own message definitions (those in
`tritonclient`): our protos carry Triton's field numbers for what they hold,
so our bytes parsed as Triton's messages must say what the JSON says.
"""

from __future__ import annotations

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as triton_mc
from tritonclient.grpc import service_pb2 as triton_pb

from inferbus_common.catalog import DeployedVersion
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.modelstats import Duration, ModelStats, sum_stats
from inferbus_gateway.triton.documents import to_proto, triton_config, triton_statistics
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb
from inferbus_proto.v2 import model_config_pb2 as mc


def _deployed(**overrides: object) -> DeployedVersion:
    fields: dict[str, object] = {
        "name": "fraud",
        "max_batch_size": 16,
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [-1, 64]},
            {"name": "tag", "datatype": "BYTES", "shape": [-1, 1]},
        ],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]}],
        "batching": {
            "max_queue_delay_us": 750,
            "preferred_batch_sizes": [4, 8],
            "max_queue_size": 99,
            "default_timeout_ms": 1500,
        },
        "instance_count": 3,
        "pool": "cpu-a",
    }
    fields.update(overrides)
    config = ModelConfig.model_validate(fields)
    return DeployedVersion(model="fraud", version="2", config=config, digest="sha256:ab")


def test_config_is_triton_shaped() -> None:
    doc = triton_config("fraud", _deployed())
    assert doc["name"] == "fraud"
    assert doc["platform"] == "onnxruntime_onnx"
    assert doc["backend"] == "onnxruntime"
    assert doc["max_batch_size"] == 16
    # dims leave out the batch axis when the model batches, as Triton's do.
    assert [(i["name"], i["data_type"], i["dims"]) for i in doc["input"]] == [
        ("input", "TYPE_FP32", [64]),
        ("tag", "TYPE_STRING", [1]),
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in doc["output"]] == [
        ("probabilities", "TYPE_FP32", [2])
    ]
    batching = doc["dynamic_batching"]
    assert batching["preferred_batch_size"] == [4, 8]
    assert batching["max_queue_delay_microseconds"] == 750
    assert batching["default_queue_policy"]["max_queue_size"] == 99
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 1_500_000
    (group,) = doc["instance_group"]
    assert (group["kind"], group["count"]) == ("KIND_CPU", 3)
    assert doc["parameters"]["inferbus_pool"] == {"string_value": "cpu-a"}
    assert doc["model_transaction_policy"] == {"decoupled": False}


def test_unbatched_config_keeps_every_dim_and_has_no_dynamic_batching() -> None:
    doc = triton_config(
        "m",
        _deployed(
            max_batch_size=0,
            inputs=[{"name": "x", "datatype": "INT32", "shape": [2, -1]}],
            outputs=[{"name": "y", "datatype": "FP16", "shape": [2]}],
            engine={"providers": ["cuda", "cpu"]},
        ),
    )
    assert doc["input"][0]["dims"] == [2, -1]
    assert doc["output"][0]["data_type"] == "TYPE_FP16"
    assert "dynamic_batching" not in doc
    assert doc["instance_group"][0]["kind"] == "KIND_GPU"


def test_instance_group_is_reported_as_configured() -> None:
    per_gpu = triton_config(
        "fraud",
        _deployed(
            instance_count=1,
            engine={"providers": ["cuda"]},
            instance_group={"count": 2, "gpus": [0, 1]},
        ),
    )
    (group,) = per_gpu["instance_group"]
    # Triton's count is per GPU listed.
    assert (group["kind"], group["count"], group["gpus"]) == ("KIND_GPU", 2, [0, 1])
    on_cpu = triton_config(
        "fraud",
        _deployed(
            instance_count=1,
            engine={"providers": ["cuda", "cpu"]},
            instance_group={"count": 2, "kind": "KIND_CPU"},
        ),
    )
    assert on_cpu["instance_group"][0]["kind"] == "KIND_CPU"
    assert on_cpu["instance_group"][0]["count"] == 2
    ours = pb.ModelConfigResponse(config=to_proto(per_gpu, mc.ModelConfig()))
    theirs = triton_pb.ModelConfigResponse.FromString(ours.SerializeToString())
    assert list(theirs.config.instance_group[0].gpus) == [0, 1]


def test_config_message_decodes_as_tritons_model_config() -> None:
    doc = triton_config("fraud", _deployed())
    ours = pb.ModelConfigResponse(config=to_proto(doc, mc.ModelConfig()))
    theirs = triton_pb.ModelConfigResponse.FromString(ours.SerializeToString())
    assert isinstance(theirs.config, triton_mc.ModelConfig)
    as_json = json_format.MessageToDict(theirs.config, preserving_proto_field_name=True)
    assert as_json["name"] == "fraud"
    assert as_json["max_batch_size"] == 16
    assert as_json["input"][0]["data_type"] == "TYPE_FP32"
    assert [int(d) for d in as_json["input"][0]["dims"]] == [64]
    assert as_json["input"][1]["data_type"] == "TYPE_STRING"
    assert as_json["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert as_json["dynamic_batching"]["max_queue_delay_microseconds"] == "750"
    assert as_json["instance_group"][0]["kind"] == "KIND_CPU"
    assert as_json["instance_group"][0]["count"] == 3
    assert as_json["backend"] == "onnxruntime"
    assert as_json["parameters"]["inferbus_version"] == {"string_value": "2"}


def _stats(rows: int, executions: int, last_ms: int) -> ModelStats:
    return ModelStats(
        inference_count=rows,
        execution_count=executions,
        last_inference_ms=last_ms,
        success=Duration(count=rows, ns=rows * 1000),
        fail=Duration(count=1, ns=50),
        queue=Duration(count=rows, ns=rows * 10),
        compute_input=Duration(count=rows, ns=0),
        compute_infer=Duration(count=rows, ns=rows * 500),
        compute_output=Duration(count=rows, ns=rows * 20),
        batches={1: [2, 0, 1000, 40], 4: [executions - 2, 0, 7000, 80]},
    )


def test_statistics_sum_workers_and_decode_as_tritons() -> None:
    total = sum_stats([_stats(10, 5, 1_700_000_000_000), _stats(6, 3, 1_700_000_000_500)])
    assert total.inference_count == 16
    assert total.execution_count == 8
    assert total.last_inference_ms == 1_700_000_000_500
    assert total.success == Duration(count=16, ns=16_000)
    assert total.batches == {1: [4, 0, 2000, 80], 4: [4, 0, 14000, 160]}
    doc = triton_statistics("fraud", "2", total)
    ours = to_proto({"model_stats": [doc]}, pb.ModelStatisticsResponse())
    theirs = triton_pb.ModelStatisticsResponse.FromString(ours.SerializeToString())
    (entry,) = theirs.model_stats
    assert (entry.name, entry.version) == ("fraud", "2")
    assert entry.inference_count == 16
    assert entry.execution_count == 8
    assert entry.last_inference == 1_700_000_000_500
    assert (entry.inference_stats.success.count, entry.inference_stats.success.ns) == (16, 16_000)
    assert entry.inference_stats.fail.count == 2
    assert entry.inference_stats.compute_infer.ns == 8_000
    batches = [(b.batch_size, b.compute_infer.count, b.compute_infer.ns) for b in entry.batch_stats]
    assert batches == [(1, 4, 2000), (4, 4, 14000)]


def test_statistics_round_trip_through_a_heartbeat_record() -> None:
    from inferbus_common.catalog import WorkerStatus

    record = WorkerStatus(worker_id="w", pool="default", stats={"fraud/2": _stats(3, 3, 9)})
    back = WorkerStatus.model_validate_json(record.model_dump_json())
    assert back.stats["fraud/2"] == _stats(3, 3, 9)
    # A record from a worker of the previous release (no stats) still reads.
    old = WorkerStatus.model_validate_json('{"worker_id": "w", "pool": "default"}')
    assert old.stats == {}


def test_sequence_model_config_reads_as_tritons_sequence_batching() -> None:
    dv = _deployed(
        inputs=[{"name": "INPUT", "datatype": "INT32", "shape": [-1, 1]}],
        outputs=[{"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]}],
        sequence_batching={
            "max_sequence_idle_us": 5_000_000,
            "max_sequences": 64,
            "controls": [
                {"kind": "start", "name": "START"},
                {"kind": "ready", "name": "READY", "datatype": "FP32"},
                {"kind": "end", "name": "END", "datatype": "BOOL"},
                {"kind": "corrid", "name": "CORRID", "datatype": "UINT64"},
            ],
            "states": [{"input": "S_IN", "output": "S_OUT", "datatype": "FP32", "shape": [4]}],
        },
    )
    doc = triton_config("seq", dv)
    assert "dynamic_batching" not in doc  # Triton's scheduling_choice is one or the other
    seq = doc["sequence_batching"]
    assert seq["max_sequence_idle_microseconds"] == 5_000_000
    assert seq["oldest"]["max_candidate_sequences"] == 64
    # Decoded with Triton's own messages.
    triton = triton_mc.ModelConfig.FromString(to_proto(doc, mc.ModelConfig()).SerializeToString())
    assert triton.WhichOneof("scheduling_choice") == "sequence_batching"
    controls = {c.name: c.control[0] for c in triton.sequence_batching.control_input}
    kind = triton_mc.ModelSequenceBatching.Control
    assert controls["START"].kind == kind.CONTROL_SEQUENCE_START
    assert list(controls["START"].int32_false_true) == [0, 1]
    assert list(controls["READY"].fp32_false_true) == [0.0, 1.0]
    assert list(controls["END"].bool_false_true) == [False, True]
    assert controls["CORRID"].data_type == triton_mc.TYPE_UINT64
    (state,) = triton.sequence_batching.state
    assert (state.input_name, state.output_name, list(state.dims)) == ("S_IN", "S_OUT", [4])
    assert state.initial_state[0].zero_data
    assert not triton.model_transaction_policy.decoupled


def test_decoupled_model_config_says_so() -> None:
    doc = triton_config("rep", _deployed(decoupled={"axis": 1}))
    assert doc["model_transaction_policy"] == {"decoupled": True}
    triton = triton_mc.ModelConfig.FromString(to_proto(doc, mc.ModelConfig()).SerializeToString())
    assert triton.model_transaction_policy.decoupled


def test_stream_and_settings_messages_decode_as_tritons() -> None:
    resp = pb.ModelStreamInferResponse(error_message="boom")
    resp.infer_response.id = "r1"
    resp.infer_response.parameters["triton_final_response"].bool_param = True
    triton = triton_pb.ModelStreamInferResponse.FromString(resp.SerializeToString())
    assert triton.error_message == "boom"
    assert triton.infer_response.parameters["triton_final_response"].bool_param
    shm = pb.SystemSharedMemoryStatusResponse()
    shm.regions["r"].CopyFrom(
        pb.SystemSharedMemoryStatusResponse.RegionStatus(name="r", key="/k", offset=8, byte_size=64)
    )
    triton_shm = triton_pb.SystemSharedMemoryStatusResponse.FromString(shm.SerializeToString())
    assert triton_shm.regions["r"].byte_size == 64
    trace = pb.TraceSettingResponse()
    trace.settings["trace_rate"].value.append("10")
    assert triton_pb.TraceSettingResponse.FromString(trace.SerializeToString()).settings[
        "trace_rate"
    ].value == ["10"]
    logs = pb.LogSettingsResponse()
    logs.settings["log_verbose_level"].uint32_param = 1
    assert (
        triton_pb.LogSettingsResponse.FromString(logs.SerializeToString())
        .settings["log_verbose_level"]
        .uint32_param
        == 1
    )
