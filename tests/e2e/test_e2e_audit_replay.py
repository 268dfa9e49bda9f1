"""Audit trail and replay through the real stack.

The gateway captures every answered request (``CAPTURE_RATE=1``) into the
audit stream. Traffic goes to version 1 of the fraud model; version 2 is the
same network except that it swaps the two class probabilities of every row
whose feature 0 is above a threshold. ``inferbus replay --from 1 --to 2``
must name exactly the requests with feature 0 above the threshold, and a
replay of version 1 against itself must find no difference.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import nats
import nats.errors
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from nats.js.api import AckPolicy, ConsumerConfig
from onnx import TensorProto, helper, numpy_helper

from inferbus_cli.__main__ import main as cli_main
from inferbus_client.registry import RegistryClient
from inferbus_common.audit import split_records
from inferbus_common.subjects import Subjects

STACK_ENV = {"INFERBUS_GATEWAY_CAPTURE_RATE": "1"}
THRESHOLD = 0.5
REQUESTS = 40


def make_swapping_version(v1_dir: Path, out: Path, threshold: float) -> Path:
    """Version 2: v1's graph, then probabilities swapped where ``input[:, 0] > threshold``."""
    shutil.copytree(v1_dir, out, ignore=shutil.ignore_patterns(".gitignore"))
    model = onnx.load(str(out / "model.onnx"))
    graph = model.graph
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == "probabilities":
                node.output[i] = "p_base"
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([0], dtype=np.int64), "col0_index"),
            numpy_helper.from_array(np.array(threshold, dtype=np.float32), "threshold"),
            numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Gather", ["input", "col0_index"], ["col0"], axis=1),
            helper.make_node("Greater", ["col0", "threshold"], ["above"]),
            helper.make_node("Sub", ["one", "p_base"], ["p_swapped"]),
            helper.make_node("Where", ["above", "p_swapped", "p_base"], ["probabilities"]),
        ]
    )
    del graph.output[:]
    graph.output.append(
        helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 2])
    )
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out / "model.onnx"))
    return out


async def _push(registry_url: str, path: Path, version: str) -> None:
    async with RegistryClient(registry_url) as client:
        await client.push(path, "fraud", version, aliases=[])


async def _captured_count(nats_url: str, version: str) -> int:
    subjects = Subjects("ib")
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        subject = subjects.audit_payload("fraud", version)
        info = await js.stream_info(subjects.audit_stream, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))
    finally:
        await nc.close()


async def _audit_records(nats_url: str) -> int:
    """Audit records of the fraud model in the stream (a message carries one per line)."""
    subjects = Subjects("ib")
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subjects.audit("fraud"),
            stream=subjects.audit_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True),
        )
        records = 0
        while True:
            try:
                msgs = await sub.fetch(256, timeout=2.0)
            except nats.errors.TimeoutError:
                return records
            records += sum(len(list(split_records(m.data))) for m in msgs)
            if msgs[-1].metadata.num_pending == 0:
                return records
    finally:
        await nc.close()


def _wait_version_ready(url: str, version: str, timeout: float = 60.0) -> None:
    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if client.is_model_ready("fraud", version):
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"fraud version {version} not ready after {timeout}s")


def _replay(stack, capsys: pytest.CaptureFixture[str], to_version: str) -> dict:
    capsys.readouterr()
    code = cli_main(
        [
            "replay",
            "fraud",
            "--from",
            "1",
            "--to",
            to_version,
            "--since",
            "1h",
            "--nats",
            stack.nats.url,
            "--url",
            stack.grpc_url,
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_replay_names_exactly_the_requests_that_differ(
    stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v2 = make_swapping_version(stack.model_dir, tmp_path / "v2", THRESHOLD)
    asyncio.run(_push(stack.registry_url, v2, "2"))
    _wait_version_ready(stack.grpc_url, "2")

    rng = np.random.default_rng(7)
    expected: set[str] = set()
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        for i in range(REQUESTS):
            x = rng.normal(0.0, 1.0, size=(1, 64)).astype(np.float32)
            request_id = f"req-{i:03d}"
            if x[0, 0] > THRESHOLD:
                expected.add(request_id)
            inp = grpcclient.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            client.infer("fraud", [inp], model_version="1", request_id=request_id)
    finally:
        client.close()
    assert 0 < len(expected) < REQUESTS  # the seed gives both kinds

    deadline = time.monotonic() + 30
    while asyncio.run(_captured_count(stack.nats.url, "1")) < REQUESTS:
        assert time.monotonic() < deadline, "captures did not reach the audit stream"
        time.sleep(0.1)
    # The plain audit records land in the same stream, apart from the payloads
    # (the gateway sends them in batches, at most INFERBUS_GATEWAY_AUDIT_BATCH_MS late).
    while asyncio.run(_audit_records(stack.nats.url)) < REQUESTS:
        assert time.monotonic() < deadline, "audit records did not reach the audit stream"
        time.sleep(0.1)

    report = _replay(stack, capsys, "2")
    assert report["failed"] == 0, report["failures"]
    assert report["replayed"] == REQUESTS
    assert set(report["different_ids"]) == expected
    assert report["different"] == len(expected)
    for diff in report["differences"]:
        (out,) = diff["outputs"]
        assert out["name"] == "probabilities"
        assert out["argmax_changed_rows"] in (0, 1)

    same = _replay(stack, capsys, "1")
    assert same["replayed"] == REQUESTS
    assert same["different_ids"] == []


def test_replay_explains_when_there_is_nothing_captured(
    stack, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(
        [
            "replay",
            "fraud",
            "--from",
            "9",
            "--to",
            "1",
            "--nats",
            stack.nats.url,
            "--url",
            stack.grpc_url,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "replayed 0" in out and "nothing to replay" in out
