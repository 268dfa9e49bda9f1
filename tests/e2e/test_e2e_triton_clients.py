"""Triton's example clients against inferbus, with models built to their contracts.

Each test is a faithful re-implementation of the calls and checks of one
script of Triton's client repository (``src/python/examples`` of
github.com/triton-inference-server/client, read at commit 58a44caa): the
same `tritonclient` calls with the same arguments and data, the same
assertions where the script prints and exits on a mismatch. CI cannot reach
GitHub (only PyPI, Debian and npm), so the scripts are not fetched here;
their code is not vendored either. The re-implementation was checked
against the real scripts run unmodified against a local stack of these
models (docs/architecture.md, "Triton's example clients", lists which
passed). Models: `inferbus_testing.tritonmodels`; the gateway reports the
server name ``triton``, as the health/metadata scripts expect.
"""

from __future__ import annotations

import asyncio
import queue
import uuid
from collections.abc import Iterator
from functools import partial

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from inferbus_testing.stack import LocalStack
from inferbus_testing.tritonmodels import WRITERS, write_all

pytestmark = pytest.mark.integration

VALUES = [11, 7, 5, 3, 2, 0, 1]
"""The sequence scripts' values."""


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A stack (two workers) serving every example model, named ``triton``."""
    base = tmp_path_factory.mktemp("triton-clients")
    stack = LocalStack(base, workers=2, env={"INFERBUS_GATEWAY_SERVER_NAME": "triton"})
    with stack:
        for name, folder in write_all(base / "models").items():
            stack.push(folder, name)
        for name in WRITERS:
            stack.wait_model_ready(name)
        yield stack


def _simple_data() -> tuple[np.ndarray, np.ndarray]:
    input0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    return input0, np.ones(shape=(1, 16), dtype=np.int32)


def _check_sum_diff(input0: np.ndarray, input1: np.ndarray, result: object) -> None:
    output0 = result.as_numpy("OUTPUT0")  # type: ignore[attr-defined]
    output1 = result.as_numpy("OUTPUT1")  # type: ignore[attr-defined]
    for i in range(16):
        assert input0[0][i] + input1[0][i] == output0[0][i], "incorrect sum"
        assert input0[0][i] - input1[0][i] == output1[0][i], "incorrect difference"


# --- simple: INT32 add/sub ---------------------------------------------------------
def test_simple_grpc_infer_client(triton: LocalStack) -> None:
    client = grpcclient.InferenceServerClient(url=triton.grpc_url)
    inputs = [
        grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    input0, input1 = _simple_data()
    inputs[0].set_data_from_numpy(input0)
    inputs[1].set_data_from_numpy(input1)
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT0"),
        grpcclient.InferRequestedOutput("OUTPUT1"),
    ]
    results = client.infer(
        model_name="simple",
        inputs=inputs,
        outputs=outputs,
        client_timeout=None,
        headers={"test": "1"},
        compression_algorithm=None,
    )
    statistics = client.get_inference_statistics(model_name="simple")
    assert len(statistics.model_stats) == 1, "Inference Statistics"
    _check_sum_diff(input0, input1, results)
    results = client.infer(model_name="simple", inputs=inputs, outputs=None)
    _check_sum_diff(input0, input1, results)
    client.close()


def _http_infer(
    client: httpclient.InferenceServerClient,
    model: str,
    input0: np.ndarray,
    input1: np.ndarray,
    *,
    with_outputs: bool,
    compression: str | None = None,
) -> httpclient.InferResult:
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(input0, binary_data=False)
    inputs[1].set_data_from_numpy(input1, binary_data=True)
    outputs = None
    if with_outputs:
        outputs = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
        ]
    return client.infer(
        model,
        inputs,
        outputs=outputs,
        query_params={"test_1": 1, "test_2": 2},
        headers=None,
        request_compression_algorithm=compression,
        response_compression_algorithm=compression,
    )


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_simple_http_infer_client(triton: LocalStack, compression: str | None) -> None:
    client = httpclient.InferenceServerClient(url=triton.http_url)
    input0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    input1 = np.full(shape=(1, 16), fill_value=-1, dtype=np.int32)
    results = _http_infer(
        client, "simple", input0, input1, with_outputs=True, compression=compression
    )
    statistics = client.get_inference_statistics(model_name="simple", headers=None)
    assert len(statistics["model_stats"]) == 1
    _check_sum_diff(input0, input1, results)
    results = _http_infer(
        client, "simple", input0, input1, with_outputs=False, compression=compression
    )
    _check_sum_diff(input0, input1, results)
    with pytest.raises(InferenceServerException) as err:
        _http_infer(client, "wrong_model_name", input0, input1, with_outputs=True).get_response()
    assert err.value.message().startswith("Request for unknown model")
    client.close()


def test_simple_grpc_async_infer_client(triton: LocalStack) -> None:
    client = grpcclient.InferenceServerClient(url=triton.grpc_url)
    inputs = [
        grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    input0, input1 = _simple_data()
    inputs[0].set_data_from_numpy(input0)
    inputs[1].set_data_from_numpy(input1)
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT0"),
        grpcclient.InferRequestedOutput("OUTPUT1"),
    ]
    done: queue.Queue = queue.Queue()

    def callback(user_data: queue.Queue, result: object, error: object) -> None:
        user_data.put(error if error else result)

    client.async_infer(
        model_name="simple",
        inputs=inputs,
        callback=partial(callback, done),
        outputs=outputs,
        client_timeout=None,
    )
    item = done.get(timeout=10)
    assert not isinstance(item, InferenceServerException), item
    _check_sum_diff(input0, input1, item)
    client.close()


def test_simple_http_async_infer_client(triton: LocalStack) -> None:
    request_count = 2
    client = httpclient.InferenceServerClient(url=triton.http_url, concurrency=request_count)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    input0, input1 = _simple_data()
    inputs[0].set_data_from_numpy(input0, binary_data=True)
    inputs[1].set_data_from_numpy(input1, binary_data=True)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
    ]
    requests = [
        client.async_infer(model_name="simple", inputs=inputs, outputs=outputs)
        for _ in range(request_count)
    ]
    for request in requests:
        _check_sum_diff(input0, input1, request.get_result())
    client.close()


def test_simple_grpc_aio_infer_client(triton: LocalStack) -> None:
    async def main() -> None:
        client = aiogrpcclient.InferenceServerClient(url=triton.grpc_url)
        inputs = [
            aiogrpcclient.InferInput("INPUT0", [1, 16], "INT32"),
            aiogrpcclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        input0, input1 = _simple_data()
        inputs[0].set_data_from_numpy(input0)
        inputs[1].set_data_from_numpy(input1)
        outputs = [
            aiogrpcclient.InferRequestedOutput("OUTPUT0"),
            aiogrpcclient.InferRequestedOutput("OUTPUT1"),
        ]
        results = await client.infer(
            model_name="simple",
            inputs=inputs,
            outputs=outputs,
            client_timeout=None,
            headers={"test": "1"},
            compression_algorithm=None,
        )
        statistics = await client.get_inference_statistics(model_name="simple")
        assert len(statistics.model_stats) == 1
        _check_sum_diff(input0, input1, results)
        result_1, result_2 = await asyncio.gather(
            client.infer(model_name="simple", inputs=inputs, outputs=None),
            client.infer(model_name="simple", inputs=inputs, outputs=None),
        )
        _check_sum_diff(input0, input1, result_1)
        _check_sum_diff(input0, input1, result_2)
        await client.close()

    asyncio.run(main())


def test_simple_http_aio_infer_client(triton: LocalStack) -> None:
    async def infer(
        client: aiohttpclient.InferenceServerClient,
        model: str,
        input0: np.ndarray,
        input1: np.ndarray,
        with_outputs: bool,
    ) -> object:
        inputs = [
            aiohttpclient.InferInput("INPUT0", [1, 16], "INT32"),
            aiohttpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(input0, binary_data=False)
        inputs[1].set_data_from_numpy(input1, binary_data=True)
        outputs = None
        if with_outputs:
            outputs = [
                aiohttpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                aiohttpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
            ]
        return await client.infer(
            model, inputs, outputs=outputs, query_params={"test_1": 1, "test_2": 2}
        )

    async def main() -> None:
        client = aiohttpclient.InferenceServerClient(url=triton.http_url)
        input0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
        input1 = np.full(shape=(1, 16), fill_value=-1, dtype=np.int32)
        results = await infer(client, "simple", input0, input1, True)
        statistics = await client.get_inference_statistics(model_name="simple")
        assert len(statistics["model_stats"]) == 1
        _check_sum_diff(input0, input1, results)
        _check_sum_diff(input0, input1, await infer(client, "simple", input0, input1, False))
        with pytest.raises(InferenceServerException) as err:
            await infer(client, "wrong_model_name", input0, input1, True)
        assert err.value.message().startswith("Request for unknown model")
        result_1, result_2 = await asyncio.gather(
            infer(client, "simple", input0, input1, True),
            infer(client, "simple", input0, input1, False),
        )
        _check_sum_diff(input0, input1, result_1)
        _check_sum_diff(input0, input1, result_2)
        await client.close()

    asyncio.run(main())


def test_simple_grpc_health_metadata(triton: LocalStack) -> None:
    client = grpcclient.InferenceServerClient(url=triton.grpc_url)
    assert client.is_server_live(headers={"test": "1", "dummy": "2"})
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.get_server_metadata().name == "triton"
    metadata = client.get_model_metadata("simple", headers={"test": "1", "dummy": "2"})
    assert metadata.name == "simple"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in err.value.message()
    assert client.get_model_config("simple").config.name == "simple"
    client.close()


def test_simple_http_health_metadata(triton: LocalStack) -> None:
    client = httpclient.InferenceServerClient(url=triton.http_url)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.get_server_metadata()["name"] == "triton"
    metadata = client.get_model_metadata("simple", query_params={"test_1": 1, "test_2": 2})
    assert metadata["name"] == "simple"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in err.value.message()
    assert client.get_model_config("simple")["name"] == "simple"
    client.close()


def test_grpc_explicit_int_content_client(triton: LocalStack) -> None:
    channel = grpc.insecure_channel(triton.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest()
    request.model_name = "simple"
    request.model_version = ""
    input0_data = list(range(16))
    input1_data = [1 for _ in range(16)]
    input0 = service_pb2.ModelInferRequest().InferInputTensor()
    input0.name, input0.datatype = "INPUT0", "INT32"
    input0.shape.extend([1, 16])
    input0.contents.int_contents[:] = input0_data
    input1 = service_pb2.ModelInferRequest().InferInputTensor()
    input1.name, input1.datatype = "INPUT1", "INT32"
    input1.shape.extend([1, 16])
    input1.contents.int_contents[:] = input1_data
    request.inputs.extend([input0, input1])
    output0 = service_pb2.ModelInferRequest().InferRequestedOutputTensor()
    output0.name = "OUTPUT0"
    output1 = service_pb2.ModelInferRequest().InferRequestedOutputTensor()
    output1.name = "OUTPUT1"
    request.outputs.extend([output0, output1])
    response = stub.ModelInfer(request)
    results = []
    for index, output in enumerate(response.outputs):
        results.append(
            np.resize(
                np.frombuffer(response.raw_output_contents[index], dtype=np.int32),
                list(output.shape),
            )
        )
    assert len(results) == 2
    for i in range(16):
        assert input0_data[i] + input1_data[i] == results[0][0][i]
        assert input0_data[i] - input1_data[i] == results[1][0][i]
    request.raw_input_contents.extend([np.array(input0_data[0:8]).tobytes()])
    request.inputs[0].contents.int_contents[:] = input0_data[8:]
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request)
    assert (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' "
        "for model 'simple'" in str(err.value)
    )
    channel.close()


# --- simple_string and simple_identity: BYTES --------------------------------------
def test_grpc_explicit_byte_content_client(triton: LocalStack) -> None:
    channel = grpc.insecure_channel(triton.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest()
    request.model_name = "simple_string"
    input0 = service_pb2.ModelInferRequest().InferInputTensor()
    input0.name, input0.datatype = "INPUT0", "BYTES"
    input0.shape.extend([1, 16])
    for i in range(16):
        input0.contents.bytes_contents.append(f"{i}".encode())
    input1 = service_pb2.ModelInferRequest().InferInputTensor()
    input1.name, input1.datatype = "INPUT1", "BYTES"
    input1.shape.extend([1, 16])
    for _ in range(16):
        input1.contents.bytes_contents.append(b"1")
    request.inputs.extend([input0, input1])
    output0 = service_pb2.ModelInferRequest().InferRequestedOutputTensor()
    output0.name = "OUTPUT0"
    output1 = service_pb2.ModelInferRequest().InferRequestedOutputTensor()
    output1.name = "OUTPUT1"
    request.outputs.extend([output0, output1])
    response = stub.ModelInfer(request)
    results = [
        np.resize(
            utils.deserialize_bytes_tensor(response.raw_output_contents[index]), list(output.shape)
        )
        for index, output in enumerate(response.outputs)
    ]
    assert len(results) == 2
    for i in range(16):
        assert i + 1 == int(results[0][0][i])
        assert i - 1 == int(results[1][0][i])
    channel.close()


@pytest.mark.parametrize("client_module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_simple_string_infer_client(triton: LocalStack, client_module: object) -> None:
    mod = client_module
    url = triton.grpc_url if mod is grpcclient else triton.http_url
    client = mod.InferenceServerClient(url=url)  # type: ignore[attr-defined]
    # simple_string_inference
    in0 = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    in1 = np.ones(shape=(1, 16), dtype=np.int32)
    expected_sum, expected_diff = np.add(in0, in1), np.subtract(in0, in1)
    inputs = [
        mod.InferInput("INPUT0", [1, 16], "BYTES"),  # type: ignore[attr-defined]
        mod.InferInput("INPUT1", [1, 16], "BYTES"),  # type: ignore[attr-defined]
    ]
    in0n = np.array([str(x).encode("utf-8") for x in in0.reshape(in0.size)], dtype=np.object_)
    in1n = np.array([str(x).encode("utf-8") for x in in1.reshape(in1.size)], dtype=np.object_)
    inputs[0].set_data_from_numpy(in0n.reshape(in0.shape))
    inputs[1].set_data_from_numpy(in1n.reshape(in1.shape))
    outputs = [
        mod.InferRequestedOutput("OUTPUT0"),  # type: ignore[attr-defined]
        mod.InferRequestedOutput("OUTPUT1"),  # type: ignore[attr-defined]
    ]
    results = client.infer(model_name="simple_string", inputs=inputs, outputs=outputs)
    output0, output1 = results.as_numpy("OUTPUT0"), results.as_numpy("OUTPUT1")
    for i in range(16):
        assert expected_sum[0][i] == int(output0[0][i]), "incorrect sum"
        assert expected_diff[0][i] == int(output1[0][i]), "incorrect difference"

    # identity_inference, with an embedded null character and with binary blobs
    def identity(np_array: np.ndarray) -> None:
        inputs = [mod.InferInput("INPUT0", np_array.shape, "BYTES")]  # type: ignore[attr-defined]
        inputs[0].set_data_from_numpy(np_array)
        outputs = [mod.InferRequestedOutput("OUTPUT0")]  # type: ignore[attr-defined]
        results = client.infer(model_name="simple_identity", inputs=inputs, outputs=outputs)
        if np_array.dtype == np.object_:
            assert np.array_equal(np_array, results.as_numpy("OUTPUT0"))
        else:
            encoded = np.char.encode(results.as_numpy("OUTPUT0").astype(str))
            assert np.array_equal(np_array, encoded)

    nulls = np.array([b"he\x00llo" for _ in range(16)], dtype=np.object_)
    identity(nulls.reshape([1, 16]))
    blobs = np.array([b"\x00\x01\x02\x03" for _ in range(16)], dtype=np.bytes_)
    identity(blobs.reshape([1, 16]))
    client.close()


# --- system shared memory ----------------------------------------------------------
def _region_count(status: object) -> int:
    """Regions in a status answer (gRPC: a message with a map; HTTP: a JSON list)."""
    return len(status.regions) if hasattr(status, "regions") else len(status)  # type: ignore[arg-type]


def _unique_key(name: str) -> str:
    """A shm key of this test run (the scripts' fixed keys could clash between runs)."""
    return f"/{name}_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("client_module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_simple_shm_client(triton: LocalStack, client_module: object) -> None:
    mod = client_module
    url = triton.grpc_url if mod is grpcclient else triton.http_url
    client = mod.InferenceServerClient(url=url)  # type: ignore[attr-defined]
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    input0_data = np.arange(start=0, stop=16, dtype=np.int32)
    input1_data = np.ones(shape=16, dtype=np.int32)
    input_byte_size = input0_data.size * input0_data.itemsize
    output_byte_size = input_byte_size
    out_key, in_key = _unique_key("output_simple"), _unique_key("input_simple")
    shm_op = shm.create_shared_memory_region("output_data", out_key, output_byte_size * 2)
    shm_ip = shm.create_shared_memory_region("input_data", in_key, input_byte_size * 2)
    try:
        client.register_system_shared_memory("output_data", out_key, output_byte_size * 2)
        shm.set_shared_memory_region(shm_ip, [input0_data])
        shm.set_shared_memory_region(shm_ip, [input1_data], offset=input_byte_size)
        client.register_system_shared_memory("input_data", in_key, input_byte_size * 2)
        inputs = [
            mod.InferInput("INPUT0", [1, 16], "INT32"),  # type: ignore[attr-defined]
            mod.InferInput("INPUT1", [1, 16], "INT32"),  # type: ignore[attr-defined]
        ]
        inputs[0].set_shared_memory("input_data", input_byte_size)
        inputs[1].set_shared_memory("input_data", input_byte_size, offset=input_byte_size)
        outputs = [
            mod.InferRequestedOutput("OUTPUT0"),  # type: ignore[attr-defined]
            mod.InferRequestedOutput("OUTPUT1"),  # type: ignore[attr-defined]
        ]
        outputs[0].set_shared_memory("output_data", output_byte_size)
        outputs[1].set_shared_memory("output_data", output_byte_size, offset=output_byte_size)
        results = client.infer(model_name="simple", inputs=inputs, outputs=outputs)
        output0 = results.get_output("OUTPUT0")
        output1 = results.get_output("OUTPUT1")
        assert output0 is not None and output1 is not None
        if mod is grpcclient:
            dtype0, shape0 = output0.datatype, output0.shape
            dtype1, shape1 = output1.datatype, output1.shape
        else:
            dtype0, shape0 = output0["datatype"], output0["shape"]
            dtype1, shape1 = output1["datatype"], output1["shape"]
        output0_data = shm.get_contents_as_numpy(shm_op, utils.triton_to_np_dtype(dtype0), shape0)
        output1_data = shm.get_contents_as_numpy(
            shm_op, utils.triton_to_np_dtype(dtype1), shape1, offset=output_byte_size
        )
        for i in range(16):
            assert input0_data[i] + input1_data[i] == output0_data[0][i], "incorrect sum"
            assert input0_data[i] - input1_data[i] == output1_data[0][i], "incorrect difference"
        assert _region_count(client.get_system_shared_memory_status()) == 2
        client.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(shm_ip)
        shm.destroy_shared_memory_region(shm_op)
    client.close()


@pytest.mark.parametrize("client_module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_simple_shm_string_client(triton: LocalStack, client_module: object) -> None:
    mod = client_module
    url = triton.grpc_url if mod is grpcclient else triton.http_url
    client = mod.InferenceServerClient(url=url)  # type: ignore[attr-defined]
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    in0 = np.arange(start=0, stop=16, dtype=np.int32)
    in1 = np.ones(shape=16, dtype=np.int32)
    input0_data = np.array([str(x).encode() for x in in0.flatten()], dtype=object).reshape(
        in0.shape
    )
    input1_data = np.array([str(x).encode() for x in in1.flatten()], dtype=object).reshape(
        in1.shape
    )
    expected_sum = np.array([str(x).encode() for x in np.add(in0, in1).flatten()], dtype=object)
    expected_diff = np.array(
        [str(x).encode() for x in np.subtract(in0, in1).flatten()], dtype=object
    )
    input0_serialized = utils.serialize_byte_tensor(input0_data)
    input1_serialized = utils.serialize_byte_tensor(input1_data)
    sizes = {
        "input0": utils.serialized_byte_size(input0_serialized),
        "input1": utils.serialized_byte_size(input1_serialized),
        "output0": utils.serialized_byte_size(utils.serialize_byte_tensor(expected_sum)),
        "output1": utils.serialized_byte_size(utils.serialize_byte_tensor(expected_diff)),
    }
    keys = {name: _unique_key(f"{name}_simple") for name in sizes}
    handles = {
        name: shm.create_shared_memory_region(f"{name}_data", keys[name], size)
        for name, size in sizes.items()
    }
    try:
        for name in ("output0", "output1", "input0", "input1"):
            client.register_system_shared_memory(f"{name}_data", keys[name], sizes[name])
        shm.set_shared_memory_region(handles["input0"], [input0_serialized])
        shm.set_shared_memory_region(handles["input1"], [input1_serialized])
        inputs = [
            mod.InferInput("INPUT0", [1, 16], "BYTES"),  # type: ignore[attr-defined]
            mod.InferInput("INPUT1", [1, 16], "BYTES"),  # type: ignore[attr-defined]
        ]
        inputs[0].set_shared_memory("input0_data", sizes["input0"])
        inputs[1].set_shared_memory("input1_data", sizes["input1"])
        kwargs = {"binary_data": True} if mod is httpclient else {}
        outputs = [
            mod.InferRequestedOutput("OUTPUT0", **kwargs),  # type: ignore[attr-defined]
            mod.InferRequestedOutput("OUTPUT1", **kwargs),  # type: ignore[attr-defined]
        ]
        outputs[0].set_shared_memory("output0_data", sizes["output0"])
        outputs[1].set_shared_memory("output1_data", sizes["output1"])
        results = client.infer(model_name="simple_string", inputs=inputs, outputs=outputs)
        got = []
        for name, handle in (("OUTPUT0", handles["output0"]), ("OUTPUT1", handles["output1"])):
            output = results.get_output(name)
            assert output is not None
            if mod is grpcclient:
                dtype, shape = output.datatype, output.shape
            else:
                dtype, shape = output["datatype"], output["shape"]
            got.append(shm.get_contents_as_numpy(handle, utils.triton_to_np_dtype(dtype), shape))
        for i in range(16):
            assert expected_sum[i] == got[0][0][i], "incorrect sum"
            assert expected_diff[i] == got[1][0][i], "incorrect difference"
        assert _region_count(client.get_system_shared_memory_status()) == 4
        client.unregister_system_shared_memory()
    finally:
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)
    client.close()


@pytest.mark.parametrize("client_module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_cuda_shared_memory_is_refused_naming_the_extension(
    triton: LocalStack, client_module: object
) -> None:
    """simple_*_cudashm_client needs a GPU; what it registers is refused clearly."""
    mod = client_module
    url = triton.grpc_url if mod is grpcclient else triton.http_url
    client = mod.InferenceServerClient(url=url)  # type: ignore[attr-defined]
    client.unregister_cuda_shared_memory()  # nothing registered: fine
    with pytest.raises(InferenceServerException) as err:
        client.register_cuda_shared_memory("output_data", "aGFuZGxl", 0, 128)
    assert "cuda_shared_memory extension" in err.value.message()
    assert err.value.status() in ("StatusCode.UNIMPLEMENTED", "400")
    client.close()


# --- sequences: simple_sequence, simple_dyna_sequence, simple_string_dyna_sequence ---
def _sequence_models(dyna: bool) -> tuple[str, str]:
    return (
        "simple_dyna_sequence" if dyna else "simple_sequence",
        "simple_string_dyna_sequence" if dyna else "simple_sequence",
    )


def _check_sequences(
    dyna: bool,
    int_ids: tuple[int, int],
    string_id: str,
    int0: list[np.ndarray],
    int1: list[np.ndarray],
    string0: list[np.ndarray],
) -> None:
    """The checks every sequence script makes on its three sequences' results."""
    assert len(int0) == len(int1) == len(string0) == len(VALUES) + 1
    for i in range(len(int0)):
        int_seq0_expected = 1 if i == 0 else VALUES[i - 1]
        int_seq1_expected = 101 if i == 0 else VALUES[i - 1] * -1
        if i == 0 and dyna:
            string_seq0_expected = 20
        elif i == 0:
            string_seq0_expected = 21
        elif dyna:
            string_seq0_expected = VALUES[i - 1] * -1 + int(string0[i - 1][0][0])
        else:
            string_seq0_expected = VALUES[i - 1] * -1
        if dyna and i != 0 and VALUES[i - 1] == 1:
            int_seq0_expected += int_ids[0]
            int_seq1_expected += int_ids[1]
            string_seq0_expected += int(string_id)
        assert (int0[i][0][0], int1[i][0][0], string0[i][0][0]) == (
            int_seq0_expected,
            int_seq1_expected,
            string_seq0_expected,
        ), f"[{i}]"


def _sequence_ids(dyna: bool, offset: int) -> tuple[int, int, str]:
    string_id = str(1002 + offset) if dyna else str(uuid.uuid4())
    return 1000 + offset * 2, 1001 + offset * 2, string_id


@pytest.mark.parametrize(
    ("client_module", "dyna", "offset"),
    [
        (grpcclient, False, 10),
        (grpcclient, True, 11),
        (httpclient, False, 12),
        (httpclient, True, 13),
    ],
    ids=["grpc", "grpc-dyna", "http", "http-dyna"],
)
def test_simple_sequence_sync_infer_client(
    triton: LocalStack, client_module: object, dyna: bool, offset: int
) -> None:
    mod = client_module
    url = triton.grpc_url if mod is grpcclient else triton.http_url
    client = mod.InferenceServerClient(url=url)  # type: ignore[attr-defined]
    int_model, string_model = _sequence_models(dyna)
    sid0, sid1, ssid = _sequence_ids(dyna, offset)

    def sync_send(results: list, values: list[int], sequence_id: object, model: str) -> None:
        for count, value in enumerate(values, start=1):
            value_data = np.full(shape=[1, 1], fill_value=value, dtype=np.int32)
            inputs = [mod.InferInput("INPUT", value_data.shape, "INT32")]  # type: ignore[attr-defined]
            inputs[0].set_data_from_numpy(value_data)
            outputs = [mod.InferRequestedOutput("OUTPUT")]  # type: ignore[attr-defined]
            result = client.infer(
                model_name=model,
                inputs=inputs,
                outputs=outputs,
                sequence_id=sequence_id,
                sequence_start=(count == 1),
                sequence_end=(count == len(values)),
            )
            results.append(result.as_numpy("OUTPUT"))

    int0: list = []
    int1: list = []
    string0: list = []
    sync_send(int0, [0, *VALUES], sid0, int_model)
    sync_send(int1, [100] + [-v for v in VALUES], sid1, int_model)
    sync_send(string0, [20] + [-v for v in VALUES], ssid, string_model)
    _check_sequences(dyna, (sid0, sid1), ssid, int0, int1, string0)
    client.close()


def _stream_requests(values: list[int], sequence_id: object, model: str) -> list[dict]:
    requests = []
    for count, value in enumerate(values, start=1):
        value_data = np.full(shape=[1, 1], fill_value=value, dtype=np.int32)
        inputs = [grpcclient.InferInput("INPUT", value_data.shape, "INT32")]
        inputs[0].set_data_from_numpy(value_data)
        requests.append(
            {
                "model_name": model,
                "inputs": inputs,
                "outputs": [grpcclient.InferRequestedOutput("OUTPUT")],
                "request_id": f"{sequence_id}_{count}",
                "sequence_id": sequence_id,
                "sequence_start": count == 1,
                "sequence_end": count == len(values),
            }
        )
    return requests


def _sort_stream_results(
    items: list[object], sid0: int, sid1: int, ssid: str
) -> tuple[list, list, list]:
    int0, int1, string0 = [], [], []
    for item in items:
        assert not isinstance(item, InferenceServerException), item
        this_id = item.get_response().id.split("_")[0]  # type: ignore[attr-defined]
        try:
            if int(this_id) == sid0:
                int0.append(item.as_numpy("OUTPUT"))  # type: ignore[attr-defined]
            elif int(this_id) == sid1:
                int1.append(item.as_numpy("OUTPUT"))  # type: ignore[attr-defined]
            elif this_id == ssid:
                string0.append(item.as_numpy("OUTPUT"))  # type: ignore[attr-defined]
            else:
                pytest.fail(f"unexpected sequence id returned by the server: {this_id}")
        except ValueError:
            string0.append(item.as_numpy("OUTPUT"))  # type: ignore[attr-defined]
    return int0, int1, string0


@pytest.mark.parametrize(("dyna", "offset"), [(False, 20), (True, 21)], ids=["plain", "dyna"])
def test_simple_grpc_sequence_stream_infer_client(
    triton: LocalStack, dyna: bool, offset: int
) -> None:
    int_model, string_model = _sequence_models(dyna)
    sid0, sid1, ssid = _sequence_ids(dyna, offset)
    done: queue.Queue = queue.Queue()

    def callback(user_data: queue.Queue, result: object, error: object) -> None:
        user_data.put(error if error else result)

    with grpcclient.InferenceServerClient(url=triton.grpc_url) as client:
        client.start_stream(callback=partial(callback, done), stream_timeout=None)
        for values, sid, model in (
            ([0, *VALUES], sid0, int_model),
            ([100] + [-v for v in VALUES], sid1, int_model),
            ([20] + [-v for v in VALUES], ssid, string_model),
        ):
            for request in _stream_requests(values, sid, model):
                client.async_stream_infer(**request)
        items = [done.get(timeout=30) for _ in range(3 * (len(VALUES) + 1))]
    _check_sequences(dyna, (sid0, sid1), ssid, *_sort_stream_results(items, sid0, sid1, ssid))


@pytest.mark.parametrize(("dyna", "offset"), [(False, 30), (True, 31)], ids=["plain", "dyna"])
def test_simple_grpc_aio_sequence_stream_infer_client(
    triton: LocalStack, dyna: bool, offset: int
) -> None:
    int_model, string_model = _sequence_models(dyna)
    sid0, sid1, ssid = _sequence_ids(dyna, offset)

    async def main() -> list[object]:
        async with aiogrpcclient.InferenceServerClient(url=triton.grpc_url) as client:

            async def requests():  # type: ignore[no-untyped-def]
                for values, sid, model in (
                    ([0, *VALUES], sid0, int_model),
                    ([100] + [-v for v in VALUES], sid1, int_model),
                    ([20] + [-v for v in VALUES], ssid, string_model),
                ):
                    for request in _stream_requests(values, sid, model):
                        yield request

            items = []
            responses = client.stream_infer(inputs_iterator=requests(), stream_timeout=None)
            async for result, error in responses:
                items.append(error if error else result)
                if len(items) == 3 * (len(VALUES) + 1):
                    break
            return items

    items = asyncio.run(main())
    _check_sequences(dyna, (sid0, sid1), ssid, *_sort_stream_results(items, sid0, sid1, ssid))


# --- repeat_int32: decoupled ---------------------------------------------------------
def test_simple_grpc_custom_repeat(triton: LocalStack) -> None:
    repeat_count, data_offset, delay_time, wait_time = 10, 100, 1000, 1000
    input_data = np.arange(start=data_offset, stop=data_offset + repeat_count, dtype=np.int32)
    delay_data = np.ones([repeat_count], dtype=np.uint32) * delay_time
    wait_data = np.array([wait_time], dtype=np.uint32)
    inputs = [
        grpcclient.InferInput("IN", [repeat_count], "INT32"),
        grpcclient.InferInput("DELAY", [repeat_count], "UINT32"),
        grpcclient.InferInput("WAIT", [1], "UINT32"),
    ]
    inputs[0].set_data_from_numpy(input_data)
    inputs[1].set_data_from_numpy(delay_data)
    inputs[2].set_data_from_numpy(wait_data)
    outputs = [grpcclient.InferRequestedOutput("OUT")]
    done: queue.Queue = queue.Queue()

    def callback(user_data: queue.Queue, result: object, error: object) -> None:
        user_data.put(error if error else result)

    with grpcclient.InferenceServerClient(url=triton.grpc_url) as client:
        client.start_stream(callback=partial(callback, done))
        client.async_stream_infer(model_name="repeat_int32", inputs=inputs, outputs=outputs)
        results = []
        for _ in range(repeat_count):
            item = done.get(timeout=30)
            assert not isinstance(item, InferenceServerException), item
            results.append(item.as_numpy("OUT"))
        # Triton's repeat backend sends its final flag alone: without
        # enable_empty_final_response no empty response follows, so the next
        # message on the stream answers the next request.
        inputs[0].set_shape([1])
        inputs[0].set_data_from_numpy(np.array([7], np.int32))
        inputs[1].set_shape([1])
        inputs[1].set_data_from_numpy(np.zeros(1, np.uint32))
        client.async_stream_infer("repeat_int32", inputs, outputs=outputs, request_id="next")
        item = done.get(timeout=30)
        assert item.get_response().id == "next" and item.as_numpy("OUT").tolist() == [7]
    expected = data_offset
    for result in results:
        assert len(result) == 1
        assert result[0] == expected
        expected += 1


def test_repeat_with_the_empty_final_response(triton: LocalStack) -> None:
    """The repeat contract as clients that ask for the final flag see it (and 0 responses)."""
    done: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url=triton.grpc_url) as client:
        client.start_stream(callback=lambda result, error: done.put(error or result))
        for n in (3, 0):
            inputs = [
                grpcclient.InferInput("IN", [n], "INT32"),
                grpcclient.InferInput("DELAY", [n], "UINT32"),
                grpcclient.InferInput("WAIT", [1], "UINT32"),
            ]
            inputs[0].set_data_from_numpy(np.arange(n, dtype=np.int32) + 5)
            inputs[1].set_data_from_numpy(np.zeros(n, np.uint32))
            inputs[2].set_data_from_numpy(np.zeros(1, np.uint32))
            client.async_stream_infer(
                "repeat_int32", inputs, request_id=f"r{n}", enable_empty_final_response=True
            )
            seen = []
            while True:
                item = done.get(timeout=30)
                assert not isinstance(item, InferenceServerException), item
                response = item.get_response()
                assert response.id == f"r{n}"
                if response.parameters["triton_final_response"].bool_param:
                    assert not response.outputs
                    break
                seen.append((int(item.as_numpy("OUT")[0]), int(item.as_numpy("IDX")[0])))
            assert seen == [(5 + i, i) for i in range(n)]
        with pytest.raises(InferenceServerException, match="decoupled"):
            client.infer("repeat_int32", inputs)


# --- trace and log settings ----------------------------------------------------------
def test_trace_and_log_settings_over_both_protocols(triton: LocalStack) -> None:
    grpc_client = grpcclient.InferenceServerClient(url=triton.grpc_url)
    http_client = httpclient.InferenceServerClient(url=triton.http_url)
    try:
        # The stack runs without a tracer: tracing reads OFF and cannot be turned on.
        assert http_client.get_trace_settings()["trace_level"] == ["OFF"]
        with pytest.raises(InferenceServerException, match="TRACING_ENABLED"):
            grpc_client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
        updated = grpc_client.update_trace_settings(
            model_name="simple", settings={"trace_rate": "7"}, as_json=True
        )
        assert updated["settings"]["trace_rate"]["value"] == ["7"]
        assert http_client.get_trace_settings(model_name="simple")["trace_rate"] == "7"
        assert http_client.get_trace_settings()["trace_rate"] != "7"
        http_client.update_trace_settings(model_name="simple", settings={"trace_rate": None})
        with pytest.raises(InferenceServerException, match="Request for unknown model"):
            http_client.get_trace_settings(model_name="wrong_model_name")
        logs = grpc_client.get_log_settings(as_json=True)["settings"]
        assert logs["log_info"]["bool_param"] is True
        assert http_client.update_log_settings({"log_info": False})["log_info"] is False
        restored = grpc_client.update_log_settings({"log_info": True}, as_json=True)
        assert restored["settings"]["log_info"]["bool_param"] is True
    finally:
        grpc_client.close()
        http_client.close()
