"""BYTES tensors end to end: string models served by a real stack, both protocols.

Two models built here with `onnx.helper` (`inferbus_testing.stringmodels`):
an identity over strings and a string → integer parser. Strings of mixed
lengths (empty, non-ASCII, with NUL bytes) must come back byte for byte over
gRPC (raw and typed contents), REST JSON and REST binary, also when
concurrent requests share a micro-batch; the parser must warm up, load and
answer numbers; a text that does not parse is the client's fault, answered
INVALID_ARGUMENT / 400 at once (no redelivery) without failing the requests
batched with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb
from inferbus_proto.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from inferbus_testing.stack import LocalStack
from inferbus_testing.stringmodels import write_identity_bytes, write_parse_int

pytestmark = pytest.mark.integration

TEXTS = [b"hello", b"", b"42", "caf\u00e9 \u2603".encode(), b"nul\x00in\x00side", b"x" * 513]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One worker serving the identity and parser string models."""
    base = tmp_path_factory.mktemp("stack")
    with LocalStack(base, workers=1) as st:
        st.push(write_identity_bytes(base / "strid"), "strid")
        st.push(write_parse_int(base / "strint"), "strint")
        st.wait_model_ready("strid")
        st.wait_model_ready("strint")
        yield st


def _column(items: list[bytes]) -> np.ndarray:
    arr = np.empty((len(items), 1), dtype=object)
    arr[:, 0] = items
    return arr


def _grpc_input(values: np.ndarray, name: str = "IN", module=grpcclient):
    inp = module.InferInput(name, list(values.shape), "BYTES")
    inp.set_data_from_numpy(values)
    return inp


def _worker_metric(stack: LocalStack, name: str, **labels: str) -> float:
    wanted = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return stack.metrics(stack.workers[0]).get(f"{name}{{{wanted}}}", 0.0)


def test_identity_over_grpc_raw(stack: LocalStack) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        values = np.array(TEXTS, dtype=object).reshape(3, 2)
        result = client.infer("strid", [_grpc_input(values)])
        out = result.as_numpy("OUT")
        assert out.shape == (3, 2)
        assert out.reshape(-1).tolist() == TEXTS
    finally:
        client.close()


def test_identity_over_grpc_typed_contents(stack: LocalStack) -> None:
    request = pb.ModelInferRequest(model_name="strid", id="typed")
    tensor = request.inputs.add(name="IN", datatype="BYTES", shape=[len(TEXTS), 1])
    tensor.contents.bytes_contents.extend(TEXTS)
    with grpc.insecure_channel(stack.grpc_url) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert [o.name for o in reply.outputs] == ["OUT"]
    assert list(reply.outputs[0].shape) == [len(TEXTS), 1]
    raw = reply.raw_output_contents[0]
    items, offset = [], 0
    while offset < len(raw):
        n = int.from_bytes(raw[offset : offset + 4], "little")
        items.append(raw[offset + 4 : offset + 4 + n])
        offset += 4 + n
    assert items == TEXTS


def test_identity_over_rest_json(stack: LocalStack) -> None:
    texts = [t.decode() for t in TEXTS]
    body = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [2, 3], "data": texts}]}
    resp = httpx.post(f"http://{stack.http_url}/v2/models/strid/infer", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    (out,) = resp.json()["outputs"]
    assert out["datatype"] == "BYTES"
    assert out["shape"] == [2, 3]
    assert out["data"] == texts


def test_identity_over_rest_binary(stack: LocalStack) -> None:
    client = httpclient.InferenceServerClient(stack.http_url)
    try:
        values = _column(TEXTS)
        inp = httpclient.InferInput("IN", list(values.shape), "BYTES")
        inp.set_data_from_numpy(values, binary_data=True)
        result = client.infer(
            "strid", [inp], outputs=[httpclient.InferRequestedOutput("OUT", binary_data=True)]
        )
        assert result.as_numpy("OUT").reshape(-1).tolist() == TEXTS
    finally:
        client.close()


def test_parser_warmed_up_and_parses_over_both_protocols(stack: LocalStack) -> None:
    texts = [b"7", b"-12", b"007", b"9000000000"]
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        result = client.infer("strint", [_grpc_input(_column(texts), "TEXT")])
    finally:
        client.close()
    assert result.as_numpy("VALUE").reshape(-1).tolist() == [7, -12, 7, 9_000_000_000]
    assert result.as_numpy("CANONICAL").reshape(-1).tolist() == [b"7", b"-12", b"7", b"9000000000"]
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1], "data": ["5", "08"]}]}
    resp = httpx.post(f"http://{stack.http_url}/v2/models/strint/infer", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    outputs = {o["name"]: o for o in resp.json()["outputs"]}
    assert outputs["VALUE"] == {
        "name": "VALUE",
        "datatype": "INT64",
        "shape": [2, 1],
        "data": [5, 8],
    }
    assert outputs["CANONICAL"]["data"] == ["5", "8"]


def test_unparsable_text_is_invalid_argument_at_once(stack: LocalStack) -> None:
    redelivered = _worker_metric(
        stack, "inferbus_worker_redeliveries_total", model="strint", version="1"
    )
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("strint", [_grpc_input(_column([b"twelve"]), "TEXT")])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "cannot compute these inputs" in err.value.message()
        assert "Cast" in err.value.message()
    finally:
        client.close()
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [""]}]}
    resp = httpx.post(f"http://{stack.http_url}/v2/models/strint/infer", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "cannot compute these inputs" in resp.json()["error"]
    # Answered from the first delivery: nothing was nak'ed and redelivered.
    assert (
        _worker_metric(stack, "inferbus_worker_redeliveries_total", model="strint", version="1")
        == redelivered
    )


def test_text_that_is_not_utf8_is_invalid_argument(stack: LocalStack) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("strid", [_grpc_input(_column([b"ok", b"\xff\xfe"]))])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "not UTF-8" in err.value.message()
    finally:
        client.close()


async def test_batched_mixed_lengths_and_a_bad_neighbour(stack: LocalStack) -> None:
    """Concurrent requests of different string lengths share micro-batches; each gets
    its own strings back, and the one text that does not parse fails alone."""
    rows_before = _worker_metric(
        stack, "inferbus_worker_batch_size_sum", model="strid", version="1"
    )
    runs_before = _worker_metric(
        stack, "inferbus_worker_batch_size_count", model="strid", version="1"
    )
    texts = [("w" * (i * 37 % 200)).encode() + str(i).encode() for i in range(24)]
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    async with httpx.AsyncClient(base_url=f"http://{stack.http_url}", timeout=30) as http:

        async def over_grpc(text: bytes) -> bytes:
            result = await client.infer("strid", [_grpc_input(_column([text]), module=grpcaio)])
            return result.as_numpy("OUT")[0, 0]

        async def over_rest(text: bytes) -> bytes:
            body = {
                "inputs": [
                    {"name": "IN", "datatype": "BYTES", "shape": [1, 1], "data": [text.decode()]}
                ]
            }
            resp = await http.post("/v2/models/strid/infer", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["outputs"][0]["data"][0].encode()

        async def parse(text: str) -> tuple[int, object]:
            body = {
                "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]
            }
            resp = await http.post("/v2/models/strint/infer", json=body)
            if resp.status_code != 200:
                return resp.status_code, resp.json()["error"]
            return 200, resp.json()["outputs"][0]["data"][0]

        try:
            echoed = await asyncio.gather(
                *(over_grpc(t) if i % 2 else over_rest(t) for i, t in enumerate(texts))
            )
            parsed = await asyncio.gather(*(parse(t) for t in ["1", "2", "oops", "4", "5", "6"]))
        finally:
            await client.close()
    assert echoed == texts
    assert [p[0] for p in parsed] == [200, 200, 400, 200, 200, 200]
    assert [p[1] for p in parsed if p[0] == 200] == [1, 2, 4, 5, 6]
    assert "Cast" in str(parsed[2][1])
    rows = _worker_metric(stack, "inferbus_worker_batch_size_sum", model="strid", version="1")
    runs = _worker_metric(stack, "inferbus_worker_batch_size_count", model="strid", version="1")
    # The 24 requests ran in fewer executions than requests: they were batched.
    assert rows - rows_before == 24
    assert runs - runs_before < 24


def test_tritonclient_sends_str_arrays_too(stack: LocalStack) -> None:
    """np.str_ / numpy unicode arrays are what many clients build; they arrive as UTF-8."""
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        values = np.array([["caf\u00e9"], ["plain"]], dtype=np.object_)
        result = client.infer("strid", [_grpc_input(values)])
        assert result.as_numpy("OUT").reshape(-1).tolist() == ["caf\u00e9".encode(), b"plain"]
    finally:
        client.close()
