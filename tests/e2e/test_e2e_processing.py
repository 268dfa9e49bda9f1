"""Pre/post-processing end to end: text in, label and score out.

The example text classifier (``examples/textcls/make_model.py``: a tokenizer
trained locally, an embedding-bag ONNX model, a labels file) is pushed through
the registry of a real stack; Triton's client sends texts; the answers must
equal the same tokenizer + onnxruntime + softmax run directly here, and carry
the ``pre`` and ``post`` stage timings.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from inferbus_testing.stack import LocalStack

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "The service was excellent and the staff were friendly",
    "terrible experience, the order arrived late",
    "",
    "caf\u00e9 \u2603 words the tokenizer never saw",
    "fast delivery " * 40,
]


class TextStack(LocalStack):
    model_dir: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TextStack]:
    """A stack (one worker) serving the example text classifier."""
    base = tmp_path_factory.mktemp("stack")
    model_dir = base / "textcls"
    subprocess.run(
        [sys.executable, str(REPO / "examples/textcls/make_model.py"), "--out", str(model_dir)],
        check=True,
        capture_output=True,
    )
    st = TextStack(base, workers=1)
    st.model_dir = model_dir
    with st:
        st.push(model_dir, "textcls")
        st.wait_model_ready("textcls")
        yield st


@pytest.fixture(scope="module")
def reference(stack: TextStack):
    """Tokenizer + onnxruntime + softmax + argmax, run directly on the pushed files."""
    tok = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=32)
    tok.enable_padding(length=32, pad_id=0)
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    labels = (stack.model_dir / "labels.txt").read_text().split()

    def run(texts: list[str]) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        enc = tok.encode_batch(texts)
        ids = np.array([e.ids for e in enc], np.int64)
        mask = np.array([e.attention_mask for e in enc], np.int64)
        (logits,) = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = z / z.sum(axis=1, keepdims=True)
        best = probs.argmax(axis=1)
        return [labels[i].encode() for i in best], probs.max(axis=1), probs

    return run


def _text_input(texts: list[str], module=grpcclient):
    values = np.array([[t.encode()] for t in texts], dtype=object)
    inp = module.InferInput("text", list(values.shape), "BYTES")
    inp.set_data_from_numpy(values)
    return inp


def test_text_in_label_out_matches_direct_run(stack: TextStack, reference) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        meta = client.get_model_metadata("textcls")
        # Clients see text in and label/score out; the token ids stay inside.
        assert [(t.name, t.datatype) for t in meta.inputs] == [("text", "BYTES")]
        assert [t.name for t in meta.outputs] == ["label", "score", "probabilities"]
        result = client.infer("textcls", [_text_input(TEXTS)], request_id="text-batch")
        labels, scores, probs = reference(TEXTS)
        assert result.as_numpy("label").reshape(-1).tolist() == labels
        np.testing.assert_allclose(result.as_numpy("score").reshape(-1), scores, rtol=1e-5)
        np.testing.assert_allclose(result.as_numpy("probabilities"), probs, rtol=1e-5, atol=1e-7)
        params = result.get_response().parameters
        assert params["inferbus_pre_us"].int64_param > 0
        assert params["inferbus_post_us"].int64_param > 0
        assert params["inferbus_compute_us"].int64_param > 0
    finally:
        client.close()


async def test_concurrent_requests_batched_together_each_get_their_answer(
    stack: TextStack, reference
) -> None:
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    texts = [f"{t} #{i}" for i, t in enumerate(TEXTS * 4)]
    try:
        results = await asyncio.gather(
            *(
                client.infer(
                    "textcls",
                    [_text_input([t], grpcaio)],
                    outputs=[grpcaio.InferRequestedOutput("label")],
                )
                for t in texts
            )
        )
    finally:
        await client.close()
    labels, _, _ = reference(texts)
    assert [r.as_numpy("label").reshape(-1)[0] for r in results] == labels
    # Only the output asked for comes back.
    assert all(r.as_numpy("score") is None for r in results)


def test_rest_server_timing_names_pre_and_post(stack: TextStack) -> None:
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": TEXTS[:2]}],
    }
    resp = httpx.post(f"http://{stack.http_url}/v2/models/textcls/infer", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    timing = resp.headers["Server-Timing"]
    assert "pre;dur=" in timing and "post;dur=" in timing, timing
    outputs = {o["name"]: o for o in resp.json()["outputs"]}
    assert outputs["label"]["datatype"] == "BYTES"
    assert outputs["label"]["shape"] == [2, 1]


def test_text_that_is_not_utf8_is_invalid_argument(stack: TextStack) -> None:
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    values = np.array([[b"\xff\xfe not text"]], dtype=object)
    inp = grpcclient.InferInput("text", [1, 1], "BYTES")
    inp.set_data_from_numpy(values)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("textcls", [inp])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "not UTF-8" in err.value.message()
        # The model keeps serving.
        ok = client.infer("textcls", [_text_input(["still fine"])])
        assert ok.as_numpy("label").shape == (1, 1)
    finally:
        client.close()
