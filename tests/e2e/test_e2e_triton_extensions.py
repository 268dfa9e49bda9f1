"""Triton's model configuration and statistics extensions with Triton's own client.

`tritonclient` 2.73, unmodified, over gRPC and HTTP against the fraud stack
(two workers): ``get_model_config`` answers a Triton-shaped config;
``get_inference_statistics`` answers the sum of both workers' counters (from
their heartbeats) and follows the requests sent; server metadata lists the
extensions.
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.integration

EXTENSIONS = {
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
}


def test_server_metadata_lists_the_extensions(stack) -> None:
    grpc_client = grpcclient.InferenceServerClient(stack.grpc_url)
    http_client = httpclient.InferenceServerClient(stack.http_url)
    try:
        assert EXTENSIONS <= set(grpc_client.get_server_metadata().extensions)
        assert EXTENSIONS <= set(http_client.get_server_metadata()["extensions"])
    finally:
        grpc_client.close()
        http_client.close()


def test_model_config_over_grpc_and_http(stack) -> None:
    grpc_client = grpcclient.InferenceServerClient(stack.grpc_url)
    http_client = httpclient.InferenceServerClient(stack.http_url)
    try:
        over_grpc = grpc_client.get_model_config("fraud", as_json=True)["config"]
        over_http = http_client.get_model_config("fraud")
        pinned = http_client.get_model_config("fraud", model_version="1")
    finally:
        grpc_client.close()
        http_client.close()
    for config in (over_grpc, over_http, pinned):
        assert config["name"] == "fraud"
        assert config["platform"] == "onnxruntime_onnx"
        assert config["backend"] == "onnxruntime"
        assert config["max_batch_size"] == 32
        (inp,) = config["input"]
        assert (inp["name"], inp["data_type"]) == ("input", "TYPE_FP32")
        assert [int(d) for d in inp["dims"]] == [64]
        (out,) = config["output"]
        assert (out["name"], out["data_type"]) == ("probabilities", "TYPE_FP32")
        assert [int(d) for d in out["dims"]] == [2]
        assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 500
        assert config["instance_group"][0]["kind"] == "KIND_CPU"
    # The HTTP form is Triton's: integers are JSON numbers.
    assert over_http["input"][0]["dims"] == [64]


def test_model_config_of_an_unknown_model_is_not_found(stack) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.get_model_config("no-such-model")
        assert err.value.status() == "StatusCode.NOT_FOUND"
    finally:
        client.close()
    resp = httpx.get(f"http://{stack.http_url}/v2/models/fraud/versions/9/config", timeout=10)
    assert resp.status_code == 404
    assert "version '9'" in resp.json()["error"]


def _count(entry: dict, *path: str) -> int:
    """A counter of a stats entry (gRPC's JSON leaves zeros out and writes int64 as text)."""
    for key in path:
        entry = entry.get(key, {})
    return int(entry or 0)


def _stats(client, **kwargs) -> dict:
    (entry,) = [
        e
        for e in client.get_inference_statistics("fraud", **kwargs)["model_stats"]
        if e["version"] == "1"
    ]
    return entry


def test_statistics_follow_the_requests_over_both_protocols(stack) -> None:
    grpc_client = grpcclient.InferenceServerClient(stack.grpc_url)
    http_client = httpclient.InferenceServerClient(stack.http_url)
    try:
        before = _stats(grpc_client, as_json=True)
        x = np.ones((3, 64), np.float32)
        for _ in range(5):
            inp = grpcclient.InferInput("input", [3, 64], "FP32")
            inp.set_data_from_numpy(x)
            grpc_client.infer("fraud", [inp])
        for _ in range(4):
            inp = httpclient.InferInput("input", [3, 64], "FP32")
            inp.set_data_from_numpy(x)
            http_client.infer("fraud", [inp])
        # Workers report in their heartbeats (every 2 s): wait for both to have.
        deadline = time.monotonic() + 20
        while True:
            after = _stats(grpc_client, as_json=True)
            if _count(after, "inference_count") >= _count(before, "inference_count") + 27:
                break
            assert time.monotonic() < deadline, after
            time.sleep(0.1)
        over_http = _stats(http_client)
    finally:
        grpc_client.close()
        http_client.close()

    # Nothing else runs in this module meanwhile: exactly these 9 requests of 3 rows.
    assert _count(after, "inference_count") - _count(before, "inference_count") == 27
    for stage in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        done = _count(after, "inference_stats", stage, "count")
        assert done - _count(before, "inference_stats", stage, "count") == 9, stage
    assert _count(after, "inference_stats", "compute_infer", "ns") > _count(
        before, "inference_stats", "compute_infer", "ns"
    )
    assert _count(after, "inference_stats", "success", "ns") >= _count(
        after, "inference_stats", "compute_infer", "ns"
    )
    executions = _count(after, "execution_count")
    assert 1 <= executions - _count(before, "execution_count") <= 9
    # Every execution is in batch_stats under its rows; rows add up to the inferences.
    batches = after["batch_stats"]
    assert sum(int(b["compute_infer"]["count"]) for b in batches) == executions
    assert sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in batches) == _count(
        after, "inference_count"
    )
    assert int(after["last_inference"]) > 0
    # HTTP answers the same figures (JSON numbers).
    assert over_http["inference_count"] == _count(after, "inference_count")
    assert over_http["execution_count"] == executions


def test_statistics_of_every_model_and_of_unknown_ones(stack) -> None:
    resp = httpx.get(f"http://{stack.http_url}/v2/models/stats", timeout=10)
    assert resp.status_code == 200
    assert ("fraud", "1") in [(e["name"], e["version"]) for e in resp.json()["model_stats"]]
    resp = httpx.get(f"http://{stack.http_url}/v2/models/nope/stats", timeout=10)
    assert resp.status_code == 404
    assert "nope" in resp.json()["error"]
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        every = client.get_inference_statistics(as_json=True)["model_stats"]
        assert ("fraud", "1") in [(e["name"], e["version"]) for e in every]
    finally:
        client.close()


# --- REST protocol details: JSON errors everywhere, compression, 413 ---------------------
# (after the statistics tests: these send inferences the counts above must not see)


@pytest.mark.parametrize(
    ("method", "path", "status", "allowed"),
    [
        ("GET", "/v2/no/such/route", 404, ""),
        ("POST", "/nothing", 404, ""),
        ("GET", "/v2/models/fraud/infer", 405, "POST"),
        ("DELETE", "/v2/models/fraud", 405, "GET"),
    ],
)
def test_unknown_routes_and_wrong_methods_answer_json_errors(
    stack, method, path, status, allowed
) -> None:
    resp = httpx.request(method, f"http://{stack.http_url}{path}", timeout=10)
    assert resp.status_code == status
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert method in error and path in error
    if allowed:
        assert allowed in resp.headers["allow"]
        assert allowed in error


def test_tritonclient_reads_a_404_as_an_error(stack) -> None:
    client = httpclient.InferenceServerClient(stack.http_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("no-such-model")
        assert "no-such-model" in err.value.message()
    finally:
        client.close()


@pytest.mark.parametrize(
    ("request_alg", "response_alg"), [("gzip", "deflate"), ("deflate", "gzip")]
)
@pytest.mark.parametrize("binary", [True, False])
def test_compressed_requests_and_responses(stack, request_alg, response_alg, binary) -> None:
    client = httpclient.InferenceServerClient(stack.http_url)
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64) / 100
    try:
        inp = httpclient.InferInput("input", [2, 64], "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = httpclient.InferRequestedOutput("probabilities", binary_data=binary)
        result = client.infer(
            "fraud",
            [inp],
            outputs=[out],
            request_compression_algorithm=request_alg,
            response_compression_algorithm=response_alg,
        )
        plain = client.infer("fraud", [inp], outputs=[out])
    finally:
        client.close()
    np.testing.assert_allclose(result.as_numpy("probabilities"), plain.as_numpy("probabilities"))
    assert result.as_numpy("probabilities").shape == (2, 2)


def test_body_over_the_limit_is_413_even_when_it_decompresses_there(stack) -> None:
    import gzip

    # 100 MB of JSON whitespace in ~100 KB of gzip: refused while decompressing.
    head = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ['
    bomb = gzip.compress(head + b" " * (100 << 20) + b"0]}]}")
    resp = httpx.post(
        f"http://{stack.http_url}/v2/models/fraud/infer",
        content=bomb,
        headers={"content-encoding": "gzip"},
        timeout=30,
    )
    assert resp.status_code == 413, resp.text
    assert "limit" in resp.json()["error"]
    resp = httpx.post(
        f"http://{stack.http_url}/v2/models/fraud/infer",
        content=b"not gzip",
        headers={"content-encoding": "gzip"},
        timeout=30,
    )
    assert resp.status_code == 400 and "gzip" in resp.json()["error"]


# --- classification extension -----------------------------------------------------------


@pytest.fixture(scope="module")
def labelled(stack, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fraud model again as "fraudcls", its output labelled by a labels file."""
    out = tmp_path_factory.mktemp("fraudcls")
    for name in ("model.onnx", "config.json"):
        (out / name).write_bytes((stack.model_dir / name).read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["name"] = "fraudcls"
    config["outputs"][0]["label_filename"] = "labels.txt"
    (out / "config.json").write_text(json.dumps(config))
    (out / "labels.txt").write_text("legit\nfraud\n")
    stack.push(out, "fraudcls")
    stack.wait_model_ready("fraudcls")
    return "fraudcls"


def _expected(probs: np.ndarray, labels: list[str] | None) -> list[list[bytes]]:
    rows = []
    for row in probs:
        best = int(np.argmax(row))
        text = f"{row[best]:f}:{best}" + (f":{labels[best]}" if labels else "")
        rows.append([text.encode()])
    return rows


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_class_count_answers_labelled_top_classes(stack, labelled, protocol) -> None:
    x = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    module = grpcclient if protocol == "grpc" else httpclient
    url = stack.grpc_url if protocol == "grpc" else stack.http_url
    client = module.InferenceServerClient(url)
    try:
        inp = module.InferInput("input", [3, 64], "FP32")
        inp.set_data_from_numpy(x)
        plain = client.infer(labelled, [inp]).as_numpy("probabilities")
        top = client.infer(
            labelled, [inp], outputs=[module.InferRequestedOutput("probabilities", class_count=1)]
        ).as_numpy("probabilities")
        # Without labels in the config: "value:index".
        unlabelled = client.infer(
            "fraud", [inp], outputs=[module.InferRequestedOutput("probabilities", class_count=1)]
        ).as_numpy("probabilities")
        config = (
            client.get_model_config(labelled, as_json=True)["config"]
            if protocol == "grpc"
            else client.get_model_config(labelled)
        )
    finally:
        client.close()
    assert top.shape == (3, 1)
    assert top.tolist() == _expected(plain, ["legit", "fraud"])
    assert unlabelled.tolist() == _expected(plain, None)
    assert config["output"][0]["label_filename"] == "labels.txt"


def test_class_count_that_is_not_a_positive_integer_is_400(stack) -> None:
    body = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}],
        "outputs": [{"name": "probabilities", "parameters": {"classification": 0}}],
    }
    resp = httpx.post(f"http://{stack.http_url}/v2/models/fraud/infer", json=body, timeout=30)
    assert resp.status_code == 400
    assert "classification must be a positive integer" in resp.json()["error"]


def test_a_labels_file_that_was_not_pushed_is_refused_at_push(stack, tmp_path) -> None:
    for name in ("model.onnx", "config.json"):
        (tmp_path / name).write_bytes((stack.model_dir / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["name"] = "fraudbad"
    config["outputs"][0]["label_filename"] = "missing.txt"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"missing\.txt.*did not send it"):
        stack.push(tmp_path, "fraudbad")
