"""One request framing per subject (issue 25; shared STYLE practice 13).

Tensor requests travel as request bundles (``IBQ1``) on ``ib.route.*`` and
``ib.infer.*.*``, are answered in reply bundles (``IBR1``) on a gateway's
inbox, and reach workers as ``IBB3`` micro-batches; a lone request is a bundle
of one. The one-message-per-request form (headers plus a bare tensor frame)
and the IBB1/IBB2 micro-batches are gone:

* statically: no source file (production or test) defines, calls or imports
  the names of the removed path, and no test branches on a bundles flag;
* live: a real router and a real batcher answer a message in the old form
  with INVALID_ARGUMENT (nothing is forwarded or queued), and still serve a
  bundle right after it.
"""

from __future__ import annotations

import ast
import asyncio
import re
import time
from pathlib import Path

import numpy as np
import pytest
from nats.aio.msg import Msg

from inferbus_common import bus
from inferbus_common.catalog import DeployedVersion, Route, ensure_kv
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import (
    BundledRequest,
    decode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_common.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

REMOVED_NAMES = {
    # gateway: the single-request call, its flag, its reply parser's only use
    "_call_single",
    # router: the single tensor path and its no-responders inbox, header shadow copies
    "_send_shadow",
    "_on_no_responders",
    "begin_bundled",
    # batcher: the single-request intake
    "admit_request",
    "admit_bundled",
    "start_queue_span",
    "_queue_for",
    # every hop: telling the two framings apart
    "is_request_bundle",
    # worker: single replies and their builders
    "ok_reply",
    "error_reply",
    # micro-batch formats other than IBB3, and the test-only encoder
    "encode_batch",
    "BATCH_MAGIC_MIRROR",
    "BATCH_MAGIC_INBOX",
    # the mirror header of header-framed shadow copies
    "MIRROR",
}
REMOVED_MODULES = {
    "inferbus_common.wire",
    "inferbus_common.bundles",
    "inferbus_common.replies",
    "inferbus_common.headers",
}
RETIRED_BYTES = re.compile(rb"IBB[12]")


def _python_files() -> list[Path]:
    roots = ("libs", "services", "cli", "tests", "bench", "scripts")
    return sorted(
        p
        for root in roots
        for p in (REPO / root).rglob("*.py")
        # .venv and .venvs (bench/.venvs: the peers' throwaway environments) are not ours.
        if not any(part.startswith(".venv") for part in p.parts)
        and "_pb2" not in p.name
        and p.resolve() != THIS
    )


def _publishes_headers_on_a_bundle_subject(node: ast.AST) -> bool:
    """``….publish(<…route(…) or …infer(…)>, …, headers=…)``: the old single form
    (headers carry the metadata) on a subject whose one framing is the bundle."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "publish"
        and node.args
        and any(k.arg == "headers" for k in node.keywords)
    ):
        return False
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in {"route", "infer"}
        for n in ast.walk(node.args[0])
    )


def _removed_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    # Tests that send the old form on purpose, to show it is refused.
    refusal_tests = [
        (f.lineno, f.end_lineno or f.lineno)
        for f in ast.walk(tree)
        if isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef)
        and "old_single_request_form_is_refused" in f.name
    ]
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Name | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = getattr(node, "id", None) or getattr(node, "name", None)
        elif isinstance(node, ast.Attribute):
            # ``tokenizer.encode_batch`` (Hugging Face tokenizers) is not ours.
            name = node.attr if node.attr != "encode_batch" else None
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in REMOVED_MODULES:
                found.append(f"imports {node.module}")
            if node.module == "inferbus_common":
                found += [
                    f"imports inferbus_common.{a.name}"
                    for a in node.names
                    if f"inferbus_common.{a.name}" in REMOVED_MODULES
                ]
            name = next((a.name for a in node.names if a.name in REMOVED_NAMES), None)
        elif isinstance(node, ast.keyword) and node.arg == "bundles":
            found.append("passes bundles= (the removed flag)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, bytes | str):
            raw = node.value if isinstance(node.value, bytes) else node.value.encode()
            if (
                # Tests may spell a retired magic to show it is refused; code may not.
                RETIRED_BYTES.search(raw) and "src" in path.parts and "hostile" not in path.name
            ):
                found.append(f"spells a retired micro-batch magic: {node.value!r}")
        if name in REMOVED_NAMES:
            found.append(f"uses {name}")
        if _publishes_headers_on_a_bundle_subject(node) and not any(
            lo <= node.lineno <= hi for lo, hi in refusal_tests
        ):
            found.append(f"line {node.lineno}: publishes headers on a route/infer subject")
    return [f"{path.relative_to(REPO)}:{f}" for f in found]


def test_the_scan_sees_the_code_it_judges() -> None:
    """The walk finds the protocol's producers and consumers (a moved tree must not
    pass vacuously)."""
    files = {p.relative_to(REPO).as_posix() for p in _python_files()}
    assert "services/gateway/src/inferbus_gateway/dispatch/dispatcher.py" in files
    assert "services/router/src/inferbus_router/router.py" in files
    assert "services/batcher/src/inferbus_batcher/intake.py" in files
    assert "services/worker-gpu/src/inferbus_worker/microbatch.py" in files
    assert "libs/testing/src/inferbus_testing/hostile.py" in files
    assert len(files) > 300


def test_no_code_path_keeps_the_single_request_form() -> None:
    found = [f for path in _python_files() for f in _removed_uses(path)]
    assert found == []


def test_no_test_branches_on_a_bundles_flag() -> None:
    flag = re.compile(r"\bif (not )?bundles\b|parametrize\(\s*\"bundles\"")
    found = [
        str(p.relative_to(REPO))
        for p in _python_files()
        if "tests" in p.parts and flag.search(p.read_text())
    ]
    assert found == []


# --- live: the old form on ib.route and ib.infer ------------------------------------

MODEL, VERSION = "fraud", "1"


async def _deploy(nc) -> None:
    subjects = Subjects()
    js = nc.jetstream()
    config = ModelConfig(
        name=MODEL,
        max_batch_size=8,
        inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 4]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
    )
    models = await ensure_kv(js, subjects.models_bucket)
    dv = DeployedVersion(model=MODEL, version=VERSION, config=config, digest="d" * 64)
    await models.put(subjects.model_key(MODEL, VERSION), dv.model_dump_json().encode())
    routes = await ensure_kv(js, subjects.routes_bucket)
    route = Route(model=MODEL, stable=VERSION, versions=[VERSION])
    await routes.put(subjects.model_key(MODEL), route.model_dump_json().encode())


@pytest.mark.integration
async def test_the_old_form_is_refused_on_route_and_infer_subjects(
    nats_server, nats_client, spawn_service
) -> None:
    await _deploy(nats_client)
    subjects = Subjects()
    router = await spawn_service(
        "inferbus_router",
        env={"INFERBUS_ROUTER_NATS_URL": nats_server.url, "INFERBUS_ROUTER_METRICS_PORT": "0"},
    )
    batcher = await spawn_service(
        "inferbus_batcher",
        env={
            "INFERBUS_BATCHER_NATS_URL": nats_server.url,
            "INFERBUS_BATCHER_METRICS_PORT": "0",
            "INFERBUS_BATCHER_STREAM_MAX_BYTES": str(8 << 20),
        },
    )
    await router.await_ready()
    await batcher.await_ready()
    old: asyncio.Queue[Msg] = asyncio.Queue()
    bundles: asyncio.Queue[Msg] = asyncio.Queue()
    await nats_client.subscribe("old.reply.*", cb=old.put)
    await nats_client.subscribe("gw.reply.b", cb=bundles.put)
    await bus.sync(nats_client)
    frame = encode_tensors([tensor_from_numpy("input", np.ones((1, 4), np.float32))])

    async def old_form(subject: str, rid: str) -> dict[str, str]:
        """Publish the old form until answered (a fresh subscription can miss the first)."""
        deadline = time.monotonic() + 15
        while True:
            headers = {
                h.REQUEST_ID: rid,
                h.MODEL: MODEL,
                h.VERSION: VERSION,
                h.REPLY: f"old.reply.{rid}",
                h.DEADLINE: str(time.time_ns() + 10**10),
            }
            await nats_client.publish(subject, frame, headers=headers)
            try:
                msg = await asyncio.wait_for(old.get(), 0.5)
            except TimeoutError:
                assert time.monotonic() < deadline, router.log_tail() + batcher.log_tail()
                continue
            while not old.empty():  # answers to earlier tries: the same answer
                old.get_nowait()
            return dict(msg.headers or {})

    for subject in (subjects.route(MODEL), subjects.infer(MODEL, VERSION)):
        got = await old_form(subject, "old")
        assert got[h.STATUS] == "INVALID_ARGUMENT", (subject, got)
        assert "request bundles (IBQ1)" in got[h.ERROR], got
        assert got[h.REQUEST_ID] == "old"
    # Nothing of it reached the work queue.
    info = await nats_client.jetstream().stream_info(subjects.batch_stream)
    assert info.state.messages == 0

    # Both still serve the one framing: a bundle of one to an undeployed version is
    # answered NOT_FOUND by the batcher; one routed by the router reaches the queue.
    env = Envelope("ok", MODEL, time.time_ns() + 10**10)
    await nats_client.publish(
        subjects.infer(MODEL, "9"),
        encode_request_bundle(MODEL, "9", "gw.reply.b", [BundledRequest(env, 7)], [(frame,)]),
    )
    reply = decode_reply_bundle((await asyncio.wait_for(bundles.get(), 10)).data)
    assert [(r.token, r.status) for r in reply.replies] == [(7, "NOT_FOUND")]
    await nats_client.publish(
        subjects.route(MODEL),
        encode_request_bundle(MODEL, "", "gw.reply.b", [BundledRequest(env, 8)], [(frame,)]),
    )
    deadline = time.monotonic() + 10
    while (await nats_client.jetstream().stream_info(subjects.batch_stream)).state.messages < 1:
        assert time.monotonic() < deadline, batcher.log_tail()
        await asyncio.sleep(0.05)
