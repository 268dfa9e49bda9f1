"""KServe V2 protobuf ↔ canonical conversions."""

from __future__ import annotations

import numpy as np
import pytest

from inferbus_common.codec import Tensor, deserialize_bytes
from inferbus_common.errors import InvalidArgument
from inferbus_gateway.canonical import InferResponse, ShmRef
from inferbus_gateway.grpc_api.converters import (
    CONTENTS_FIELD,
    request_from_proto,
    response_to_proto,
)
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

TYPED = {
    "BOOL": [True, False],
    "INT8": [-3, 4],
    "INT16": [-300, 4],
    "INT32": [-70000, 4],
    "INT64": [-(2**40), 4],
    "UINT8": [3, 250],
    "UINT16": [3, 60000],
    "UINT32": [3, 4_000_000_000],
    "UINT64": [3, 2**60],
    "FP32": [1.5, -2.25],
    "FP64": [1.5, -2.25],
}


@pytest.mark.parametrize("datatype", sorted(TYPED))
def test_typed_contents_become_raw_bytes(datatype: str) -> None:
    values = TYPED[datatype]
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype=datatype, shape=[1, 2])
    getattr(t.contents, CONTENTS_FIELD[datatype]).extend(values)
    canonical = request_from_proto(req, None)
    got = canonical.inputs[0].as_numpy()
    assert got.shape == (1, 2)
    assert got.reshape(-1).tolist() == values


def test_typed_bytes_contents() -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="s", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"ab", b""])
    canonical = request_from_proto(req, None)
    assert deserialize_bytes(canonical.inputs[0].data) == [b"ab", b""]


def test_raw_contents_pass_through_and_parameters() -> None:
    arr = np.arange(6, dtype=np.float16).reshape(2, 3)
    req = pb.ModelInferRequest(model_name="m", model_version="2", id="abc")
    req.inputs.add(name="x", datatype="FP16", shape=[2, 3])
    req.raw_input_contents.append(arr.tobytes())
    req.outputs.add(name="y")
    req.parameters["priority"].uint64_param = 2
    req.parameters["timeout"].int64_param = 250_000
    canonical = request_from_proto(req, 5.0)
    assert np.array_equal(canonical.inputs[0].as_numpy(), arr)
    assert canonical.outputs == ["y"]
    assert canonical.priority == 2
    assert canonical.timeout_s == pytest.approx(0.25)
    assert (canonical.model, canonical.version, canonical.id) == ("m", "2", "abc")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda r: r.inputs.add(name="x", datatype="FP17", shape=[1]), "unknown datatype"),
        (
            lambda r: r.inputs.add(name="x", datatype="FP16", shape=[1]),
            "no typed contents field",
        ),
        (
            lambda r: r.inputs.add(
                name="x", datatype="FP32", shape=[1, 3]
            ).contents.fp32_contents.extend([1.0]),
            "needs 3",
        ),
        (lambda r: r.raw_input_contents.append(b"1234"), "raw_input_contents has 1 entries"),
    ],
)
def test_malformed_requests_are_invalid_argument(build, message: str) -> None:
    req = pb.ModelInferRequest(model_name="m")
    build(req)
    with pytest.raises(InvalidArgument, match=message):
        request_from_proto(req, None)


def test_response_has_raw_outputs_and_timings() -> None:
    y = np.array([[0.25, 0.75]], dtype=np.float32)
    from inferbus_common.codec import tensor_from_numpy

    resp = InferResponse(
        "m", "1", "id1", [tensor_from_numpy("y", y)], {"queue": 0.5, "total": 2.0}, "d1"
    )
    out = response_to_proto(resp)
    assert out.outputs[0].shape == [1, 2]
    assert np.frombuffer(out.raw_output_contents[0], dtype=np.float32).tolist() == [0.25, 0.75]
    assert out.parameters["inferbus_queue_us"].int64_param == 500
    assert out.parameters["inferbus_digest"].string_param == "d1"


def test_model_metadata_has_only_v2_tensor_fields() -> None:
    from inferbus_common.tensorspec import TensorSpec
    from inferbus_gateway.service import _tensor_metadata

    spec = TensorSpec(name="s", datatype="BYTES", shape=[-1], max_element_bytes=8, truncate=True)
    md = _tensor_metadata(spec)
    assert md == {"name": "s", "datatype": "BYTES", "shape": [-1]}
    pb.ModelMetadataResponse().inputs.add(**md)  # accepted by the V2 message


@pytest.mark.parametrize("kind", ["string_param", "double_param", "bool_param"])
@pytest.mark.parametrize("key", ["timeout", "priority"])
def test_timeout_and_priority_that_are_not_integers_are_refused(key: str, kind: str) -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1])
    t.contents.fp32_contents.append(1.0)
    setattr(req.parameters[key], kind, {"string_param": "5", "double_param": 5.0}.get(kind, True))
    with pytest.raises(InvalidArgument, match=f"parameter '{key}' must be a non-negative"):
        request_from_proto(req, None)


def test_negative_timeout_is_refused() -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1])
    t.contents.fp32_contents.append(1.0)
    req.parameters["timeout"].int64_param = -1
    with pytest.raises(InvalidArgument, match="non-negative"):
        request_from_proto(req, None)


def test_values_in_two_typed_fields_are_refused() -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="FP32", shape=[2])
    t.contents.fp32_contents.extend([1.0, 2.0])
    t.contents.int_contents.extend([3, 4])
    with pytest.raises(InvalidArgument, match=r"contents\.int_contents must be empty"):
        request_from_proto(req, None)


def test_raw_and_typed_contents_in_one_request_are_refused() -> None:
    req = pb.ModelInferRequest(model_name="m")
    a = req.inputs.add(name="a", datatype="FP32", shape=[1])
    a.contents.fp32_contents.append(1.0)
    req.inputs.add(name="b", datatype="FP32", shape=[1])
    req.raw_input_contents.extend([np.float32(1).tobytes(), np.float32(2).tobytes()])
    with pytest.raises(
        InvalidArgument,
        match="contents field must not be specified when using raw_input_contents for 'a' "
        "for model 'm'",
    ):
        request_from_proto(req, None)


def test_sequence_parameters_become_sequence_flags() -> None:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="INT32", shape=[1]).contents.int_contents.append(1)
    req.parameters["sequence_id"].int64_param = 1000
    req.parameters["sequence_start"].bool_param = True
    flags = request_from_proto(req, None).sequence
    assert flags is not None and (flags.id, flags.start, flags.end) == (1000, True, False)
    req.parameters["sequence_id"].string_param = "abc"
    req.parameters["sequence_end"].bool_param = True
    flags = request_from_proto(req, None).sequence
    assert flags is not None and (flags.id, flags.start, flags.end) == ("abc", True, True)
    req.parameters["sequence_id"].int64_param = 0
    with pytest.raises(InvalidArgument, match="need a non-zero sequence_id"):
        request_from_proto(req, None)
    del req.parameters["sequence_start"]
    del req.parameters["sequence_end"]
    assert request_from_proto(req, None).sequence is None
    req.parameters["sequence_id"].int64_param = 5
    req.parameters["sequence_start"].int64_param = 1
    with pytest.raises(InvalidArgument, match="must be a bool"):
        request_from_proto(req, None)


def test_shared_memory_inputs_and_outputs_are_named_not_sent() -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="INT32", shape=[1, 16])
    t.parameters["shared_memory_region"].string_param = "in"
    t.parameters["shared_memory_byte_size"].int64_param = 64
    o = req.outputs.add(name="y")
    o.parameters["shared_memory_region"].string_param = "out"
    o.parameters["shared_memory_byte_size"].int64_param = 64
    o.parameters["shared_memory_offset"].int64_param = 64
    canonical = request_from_proto(req, None)
    assert canonical.shm_inputs["x"].byte_size == 64 and canonical.inputs[0].data == b""
    assert canonical.shm_outputs["y"].offset == 64
    t.contents.int_contents.extend(range(16))
    with pytest.raises(InvalidArgument, match="in shared memory"):
        request_from_proto(req, None)


def test_a_shared_memory_output_is_not_classified_like_triton() -> None:
    req = pb.ModelInferRequest(model_name="m")
    o = req.outputs.add(name="y")
    o.parameters["shared_memory_region"].string_param = "out"
    o.parameters["shared_memory_byte_size"].int64_param = 64
    o.parameters["classification"].int64_param = 1
    with pytest.raises(InvalidArgument, match="both 'shared_memory_region' and 'classification'"):
        request_from_proto(req, None)


def test_shared_memory_outputs_keep_their_place_with_an_empty_raw_entry() -> None:
    # Triton keeps one raw entry per output (empty for one in shared memory);
    # its C++ client reads raw_output_contents by the output's position.
    resp = InferResponse(
        model="m",
        version="1",
        id="r",
        outputs=[Tensor("y", "INT32", (1, 16), b""), Tensor("z", "INT32", (1,), b"\x01\0\0\0")],
        shm_outputs={"y": ShmRef("out", 64, 8)},
    )
    msg = response_to_proto(resp)
    y, z = msg.outputs
    assert (y.name, y.datatype, list(y.shape)) == ("y", "INT32", [1, 16])
    assert not y.parameters and not z.parameters
    assert list(msg.raw_output_contents) == [b"", b"\x01\0\0\0"]
