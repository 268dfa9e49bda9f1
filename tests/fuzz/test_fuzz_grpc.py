"""Hostile KServe V2 gRPC requests (issue #11, item 3): raw bytes on the
channel, from well-formed requests with hostile fields to broken protobuf.
Every one is answered with a client error (INVALID_ARGUMENT, NOT_FOUND, ...)
or, when it happens to be valid, a result (or DEADLINE_EXCEEDED when it asks for
a deadline of microseconds); never INTERNAL/UNKNOWN/UNAVAILABLE, never a hang.
The stack keeps serving.

``INFERBUS_FUZZ_EXAMPLES=10000`` runs the long variant.
"""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from inferbus_testing.hostile import CLIENT_ERRORS_GRPC, examples, grpc_payloads, record

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

METHOD = "/inference.GRPCInferenceService/ModelInfer"
TIMEOUT_S = 10.0
SHORT_TIMEOUT_US = 100_000
"""A request whose own KServe ``timeout`` (µs) is shorter than this may expire
before any answer: DEADLINE_EXCEEDED is then its right answer, not a fault."""


def _asks_for_a_short_deadline(payload: bytes) -> bool:
    from google.protobuf.message import DecodeError

    from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

    try:
        req = pb.ModelInferRequest.FromString(payload)
    except (DecodeError, ValueError):
        return False
    if "timeout" not in req.parameters:
        return False
    param = req.parameters["timeout"]
    return (
        param.WhichOneof("parameter_choice") == "int64_param"
        and 0 < param.int64_param < SHORT_TIMEOUT_US
    )


@pytest.fixture(scope="module")
def channel(fuzz_stack):
    ch = grpc.insecure_channel(
        fuzz_stack.grpc_url, options=[("grpc.max_send_message_length", 200 << 20)]
    )
    yield ch
    ch.close()


def _call(channel: grpc.Channel, payload: bytes) -> tuple[str, str]:
    call = channel.unary_unary(METHOD)  # no serializers: raw bytes both ways
    try:
        call(payload, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


def test_hostile_grpc_requests_get_client_errors(fuzz_stack, channel) -> None:
    counts: collections.Counter[str] = collections.Counter()
    bad: list[str] = []

    @settings(
        max_examples=examples(),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(payload=grpc_payloads)
    def check(payload: bytes) -> None:
        status, details = _call(channel, payload)
        counts[status] += 1
        if status == "DEADLINE_EXCEEDED" and _asks_for_a_short_deadline(payload):
            return
        if status not in CLIENT_ERRORS_GRPC:
            bad.append(f"{status}: {details[:200]} <- {payload[:120]!r}")
        assert status in CLIENT_ERRORS_GRPC, f"{status}: {details} for {payload[:200]!r}"

    try:
        check()
    finally:
        record("grpc", counts, failures=bad[:5])
        print(dict(counts))
    fuzz_stack.assert_serving()


def test_100_mb_grpc_message_is_refused(fuzz_stack, channel) -> None:
    from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

    rows = (100 << 20) // 256
    req = pb.ModelInferRequest(model_name="fraud")
    req.inputs.add(name="input", datatype="FP32", shape=[rows, 64])
    req.raw_input_contents.append(bytes(rows * 256))
    status, details = _call(channel, req.SerializeToString())
    assert status in {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}, (status, details)
    fuzz_stack.assert_serving()
