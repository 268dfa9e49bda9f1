"""Hostile input for the gateway and the bus (issue #11, item 3), as hypothesis strategies.

Three targets:

* **KServe V2 gRPC** `ModelInfer`, sent as raw bytes on the channel (no client
  serializer), so the bytes can be anything: well-formed requests with
  hostile fields (shapes that do not match the bytes, negative or enormous
  dimensions, products that overflow int64, unknown datatypes, BYTES with
  broken length prefixes, duplicate inputs, CR/LF in ids), names that are
  not UTF-8 (spliced into the wire format, which protobuf would not
  serialize), and truncated or corrupted protobuf.
* **REST** ``POST /v2/models/<m>/infer``: JSON documents with the same
  hostile fields, invalid or deeply nested JSON, binary-extension bodies with
  wrong header lengths, non-UTF-8 bytes and odd model names in the path.
* **NATS**: garbage bodies and headers published straight onto the subjects
  the services listen on (`nats_garbage`).

Each strategy yields what to send; `classify_grpc` / the REST check decide
whether the answer is acceptable: a client error (gRPC INVALID_ARGUMENT,
NOT_FOUND, ...; HTTP 4xx) or a correct answer, never a server error.

``INFERBUS_FUZZ_EXAMPLES`` sets the number of examples per test (CI: a few
hundred); ``INFERBUS_FUZZ_REPORT`` names a JSON file that the tests append
their counts to (for ``docs/reliability.md``).
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

__all__ = [
    "CLIENT_ERRORS_GRPC",
    "MODEL",
    "examples",
    "grpc_payloads",
    "nats_garbage",
    "record",
    "rest_requests",
]

MODEL = "fraud"
"""The model the stack serves: input FP32 [-1, 64], output probabilities FP32 [-1, 2]."""

CLIENT_ERRORS_GRPC = {
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
    "RESOURCE_EXHAUSTED",
    "UNIMPLEMENTED",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
}
"""gRPC statuses that blame the request (or accept it); anything else is the server's fault."""

INT64_MAX = 2**63 - 1
DATATYPES = ["FP32", "FP16", "FP64", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES", "BF16"]
HOSTILE_TEXT = [
    "",
    "fraud",
    "input",
    "probabilities",
    "a" * 300,
    "x\r\nSet-Cookie: evil=1",
    "id\r\n\r\nHTTP/1.1 200 OK",
    "\x00",
    "../../etc/passwd",
    "ünïcödé-名前",
    "%0d%0a",
    "\ud7ff",
    "$",
    "ib.route.>",
    "*",
]


def examples(default: int = 200) -> int:
    """Examples per fuzz test: ``INFERBUS_FUZZ_EXAMPLES`` or `default`."""
    return int(os.environ.get("INFERBUS_FUZZ_EXAMPLES", default))


def record(kind: str, counts: Counter[str], **extra: Any) -> None:
    """Append one test's counts to ``INFERBUS_FUZZ_REPORT`` (a JSON-lines file), if set."""
    path = os.environ.get("INFERBUS_FUZZ_REPORT")
    if not path:
        return
    with Path(path).open("a") as f:
        f.write(json.dumps({"kind": kind, "counts": dict(counts), **extra}) + "\n")


# --- shared pieces -------------------------------------------------------------------------

text = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=40))
dims = st.one_of(
    st.sampled_from([0, 1, 2, 64, -1, -2, 2**31, 2**32 + 1, 2**62, INT64_MAX, -(2**63)]),
    st.integers(min_value=-(2**63), max_value=INT64_MAX),
    st.integers(min_value=0, max_value=128),
)
shapes = st.one_of(
    st.just([1, 64]),
    st.lists(st.integers(1, 4), min_size=1, max_size=1).map(lambda b: [b[0], 64]),
    st.lists(dims, max_size=6),
)
datatypes = st.one_of(st.sampled_from(DATATYPES), text)


def _bytes_tensor(elements: list[bytes], corrupt: int) -> bytes:
    """BYTES serialisation (4-byte little-endian length, then bytes), optionally broken."""
    out = b"".join(struct.pack("<I", len(e)) + e for e in elements)
    if corrupt == 1 and out:
        return out[:-1]  # last element cut short
    if corrupt == 2:
        return out + struct.pack("<I", 0xFFFFFFFF)  # a length that runs past the end
    if corrupt == 3:
        return b"\x01\x00"  # not even a whole length prefix
    return out


@st.composite
def _contents(draw: st.DrawFn, datatype: str, shape: list[int]) -> bytes:
    """Bytes for one input: right-sized for the shape, a little off, or arbitrary."""
    size = {"FP32": 4, "INT32": 4, "FP64": 8, "INT64": 8, "FP16": 2, "BF16": 2}.get(datatype, 1)
    count = 1
    for d in shape:
        count *= d
    choice = draw(st.integers(0, 4))
    if datatype == "BYTES":
        elements = draw(st.lists(st.binary(max_size=20), max_size=4))
        return _bytes_tensor(elements, draw(st.integers(0, 3)))
    if choice <= 1 and 0 <= count * size <= 1 << 16:
        return bytes(count * size)
    if choice == 2 and 0 < count * size <= 1 << 16:
        return bytes(count * size + draw(st.sampled_from([-1, 1, 3, size])))
    return draw(st.binary(max_size=600))


# --- gRPC -------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


@st.composite
def _grpc_request(draw: st.DrawFn) -> bytes:
    req = pb.ModelInferRequest(
        model_name=draw(st.one_of(st.just(MODEL), text)),
        model_version=draw(st.sampled_from(["", "", "1", "999", "-1", "1.0.0", "stable"])),
        id=draw(text),
    )
    n_inputs = draw(st.integers(0, 3))
    raw = draw(st.booleans())
    for _ in range(n_inputs):
        name = draw(st.one_of(st.just("input"), text))
        datatype = draw(datatypes)
        shape = draw(shapes)
        tensor = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw:
            req.raw_input_contents.append(draw(_contents(datatype, shape)))
        else:
            kind = draw(st.integers(0, 3))
            if kind == 0:
                tensor.contents.fp32_contents.extend(
                    draw(st.lists(st.floats(width=32, allow_nan=True), max_size=70))
                )
            elif kind == 1:
                tensor.contents.int64_contents.extend(
                    draw(st.lists(st.integers(-(2**63), INT64_MAX), max_size=10))
                )
            elif kind == 2:
                tensor.contents.bytes_contents.extend(
                    draw(st.lists(st.binary(max_size=30), max_size=5))
                )
    if draw(st.booleans()):
        req.raw_input_contents.extend(draw(st.lists(st.binary(max_size=300), max_size=2)))
    for _ in range(draw(st.integers(0, 2))):
        req.outputs.add(name=draw(st.one_of(st.just("probabilities"), text)))
    if draw(st.booleans()):
        req.parameters["timeout"].int64_param = draw(
            st.one_of(st.integers(-(2**63), INT64_MAX), st.integers(1, 10_000_000))
        )
    if draw(st.booleans()):
        key = draw(st.sampled_from(["priority", "binary_data_output", "sequence_id", "x"]))
        param = req.parameters[key]
        which = draw(st.integers(0, 2))
        if which == 0:
            param.int64_param = draw(st.integers(-(2**63), INT64_MAX))
        elif which == 1:
            param.string_param = draw(text)
        else:
            param.bool_param = draw(st.booleans())
    wire = req.SerializeToString()
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and wire:
        # Truncated protobuf.
        return wire[: draw(st.integers(0, len(wire) - 1))]
    if mutation == 1 and wire:
        # A byte flipped somewhere.
        i = draw(st.integers(0, len(wire) - 1))
        return wire[:i] + bytes([wire[i] ^ draw(st.integers(1, 255))]) + wire[i + 1 :]
    if mutation == 2:
        # A model name (field 1) or input name that is not UTF-8, spliced in on
        # the wire: protobuf itself refuses to serialize such a string.
        bad = draw(st.sampled_from([b"\xff\xfe", b"fr\xc3aud", b"\xed\xa0\x80", b"\x80"]))
        return b"\x0a" + _varint(len(bad)) + bad + wire
    if mutation == 3:
        # An unknown field with a length that runs past the end.
        return wire + b"\x9a\x07" + _varint(1 << 20) + b"xx"
    return wire


@st.composite
def _valid_grpc_request(draw: st.DrawFn) -> bytes:
    """A request the model accepts (so the fuzz also runs the whole path), maybe one field off."""
    rows = draw(st.integers(1, 4))
    req = pb.ModelInferRequest(model_name=MODEL, id=draw(text))
    req.inputs.add(name="input", datatype="FP32", shape=[rows, 64])
    values = draw(st.lists(st.floats(width=32), min_size=rows * 64, max_size=rows * 64))
    req.raw_input_contents.append(struct.pack(f"<{rows * 64}f", *values))
    tweak = draw(st.integers(0, 5))
    if tweak == 1:
        req.inputs[0].shape[0] = draw(dims)
    elif tweak == 2:
        req.inputs.add(name="input", datatype="FP32", shape=[rows, 64])  # a duplicate
        req.raw_input_contents.append(req.raw_input_contents[0])
    elif tweak == 3:
        req.outputs.add(name=draw(text))
    return req.SerializeToString()


grpc_payloads = st.one_of(_valid_grpc_request(), _grpc_request(), st.binary(max_size=400))
"""Raw request bytes for ``/inference.GRPCInferenceService/ModelInfer``."""


# --- REST -----------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        text,
    ),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def _rest_doc(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 5)) == 0:
        rows = draw(st.integers(1, 3))
        finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
        data = draw(st.lists(finite, min_size=rows * 64, max_size=rows * 64))
        return {
            "id": draw(text),
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 64], "data": data}],
        }
    inputs = []
    for _ in range(draw(st.integers(0, 3))):
        item: dict[str, Any] = {
            "name": draw(st.one_of(st.just("input"), text, json_values)),
            "datatype": draw(st.one_of(datatypes, json_values)),
            "shape": draw(st.one_of(shapes, json_values)),
        }
        choice = draw(st.integers(0, 4))
        if choice == 0:
            item["data"] = [0.0] * 64
        elif choice == 1:
            item["data"] = draw(st.lists(st.one_of(st.floats(), st.integers(), text), max_size=70))
        elif choice == 2:
            item["data"] = draw(json_values)
        elif choice == 3:
            item["parameters"] = {"binary_data_size": draw(st.one_of(dims, json_values))}
        inputs.append(item)
    doc: dict[str, Any] = {"inputs": draw(st.one_of(st.just(inputs), json_values))}
    if draw(st.booleans()):
        doc["id"] = draw(st.one_of(text, json_values))
    if draw(st.booleans()):
        doc["outputs"] = draw(st.one_of(st.just([{"name": "probabilities"}]), json_values))
    if draw(st.booleans()):
        doc["parameters"] = draw(st.one_of(st.just({"binary_data_output": True}), json_values))
    return draw(st.one_of(st.just(doc), json_values))


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@st.composite
def rest_requests(draw: st.DrawFn) -> tuple[str, dict[str, str], bytes]:
    """(path, headers, body) of a hostile ``POST /v2/models/.../infer``."""
    model = draw(
        st.one_of(
            st.just(MODEL),
            st.sampled_from(["nope", "%ff%fe", "fraud%00", "a" * 300, "fraud%2F..%2F..", ".."]),
        )
    )
    version = draw(st.sampled_from(["", "", "/versions/1", "/versions/999", "/versions/%ff"]))
    path = f"/v2/models/{model}{version}/infer"
    headers: dict[str, str] = {"content-type": "application/json"}
    kind = draw(st.integers(0, 9))
    if kind <= 4:
        body = json.dumps(draw(_rest_doc())).encode()
    elif kind == 5:
        body = draw(st.binary(max_size=400))  # not JSON, maybe not UTF-8
    elif kind == 6:
        body = _nested(draw(st.sampled_from([100, 1_000, 10_000, 200_000])))
    elif kind == 7:
        # Binary extension: JSON header then raw bytes, with a header length that lies.
        head = json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": draw(datatypes),
                        "shape": draw(shapes),
                        "parameters": {"binary_data_size": draw(dims)},
                    }
                ]
            }
        ).encode()
        body = head + draw(st.binary(max_size=400))
        headers["inference-header-content-length"] = str(draw(st.one_of(st.just(len(head)), dims)))
        headers["content-type"] = "application/octet-stream"
    elif kind == 8:
        body = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ['
        body += b"1e999, " * draw(st.integers(0, 70)) + b"NaN]}]}"
    else:
        body = json.dumps({"inputs": [], "id": draw(text)}).encode() + draw(st.binary(max_size=8))
    if draw(st.booleans()):
        headers["inferbus-timeout-ms"] = draw(
            st.sampled_from(["-1", "0", "nan", "inf", "1e309", "abc", "100", "2000"])
        )
    return path, headers, body


# --- NATS -----------------------------------------------------------------------------------

HEADER_NAMES = [
    "Ib-Request-Id",
    "Ib-Deadline",
    "Ib-Tenant",
    "Ib-Priority",
    "Ib-Model",
    "Ib-Version",
    "Ib-Reply",
    "Ib-Outputs",
    "Ib-Status",
    "Ib-Error",
    "Ib-Timings",
    "Ib-Batch-Size",
    "Ib-Kind",
    "Ib-Sticky-Key",
    "traceparent",
    "Nats-Msg-Id",
]
_header_value = st.one_of(
    st.sampled_from(
        ["", "0", "-1", "fraud", "1", "99999999999999999999999", "nan", "ib.reply.x.1", "stable"]
    ),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
)


@st.composite
def nats_garbage(draw: st.DrawFn, subjects: list[str]) -> tuple[str, dict[str, str], bytes]:
    """(subject, headers, body) of a message a buggy or hostile publisher might send."""
    subject = draw(st.sampled_from(subjects))
    headers = draw(st.dictionaries(st.sampled_from(HEADER_NAMES), _header_value, max_size=6))
    body_kind = draw(st.integers(0, 3))
    if body_kind == 0:
        body = draw(st.binary(max_size=300))
    elif body_kind == 1:
        # Looks like our frames (IBT1 tensors, IBQ1/IBR1 request and reply bundles,
        # IBB3 micro-batches; IBB1 is the retired micro-batch magic) but is not.
        magic = draw(st.sampled_from([b"IBT1", b"IBQ1", b"IBR1", b"IBB3", b"IBB1"]))
        body = magic + draw(st.binary(max_size=200))
    elif body_kind == 2:
        body = json.dumps(draw(json_values)).encode()
    else:
        body = b""
    return subject, headers, body
