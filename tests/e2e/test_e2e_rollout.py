"""Progressive rollouts on the whole stack: the registry's controller moves the canary
weight, the router splits traffic by it, the gateway's audit records judge each step.

* a canary whose model fails on real inputs (it passes warm-up on zeros, then
  every request it gets ends INTERNAL) is rolled back at its first step;
* a healthy canary reaches 100 % and becomes stable; each step is an event and a
  route change; the route afterwards has no canary left, and revisions only grow.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import numpy as np
import onnx
import pytest
import tritonclient.grpc.aio as grpcaio
from nats.aio.client import Client
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from inferbus_common import bus
from inferbus_common.catalog import Route
from inferbus_common.subjects import Subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_ENV = {
    # A failing batch is answered INTERNAL at once instead of after redeliveries.
    "INFERBUS_WORKER_MAX_DELIVER": "1",
    "INFERBUS_WORKER_UNLOAD_GRACE_S": "1",
    "INFERBUS_REGISTRY_ROLLOUT_TICK_S": "0.1",
}

REPO = Path(__file__).resolve().parents[2]


def write_failing_model(src: Path, out: Path) -> Path:
    """The fraud model plus a Reshape whose shape depends on the input values.

    All-zero inputs (the worker's warm-up) reshape to [-1, 2] and pass; any
    non-zero input asks for [-1, 1002], which onnxruntime refuses at run time:
    the version loads and reports ready, then fails every real request.
    """
    model = onnx.load(str(src / "model.onnx"))
    g = model.graph
    for node in g.node:
        for i, name in enumerate(node.output):
            if name == "probabilities":
                node.output[i] = "p0"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([1.0], np.float32), "one"),
            numpy_helper.from_array(np.array([-1, 2], np.int64), "base"),
            numpy_helper.from_array(np.array([0, 1000], np.int64), "bump"),
        ]
    )
    g.node.extend(
        [
            helper.make_node("Abs", ["input"], ["ax"]),
            helper.make_node("ReduceSum", ["ax"], ["s"], keepdims=0),
            helper.make_node("Min", ["s", "one"], ["m1"]),
            helper.make_node("Ceil", ["m1"], ["c1"]),
            helper.make_node("Cast", ["c1"], ["ci"], to=TensorProto.INT64),
            helper.make_node("Mul", ["bump", "ci"], ["bb"]),
            helper.make_node("Add", ["base", "bb"], ["shape"]),
            helper.make_node("Reshape", ["p0", "shape"], ["probabilities"]),
        ]
    )
    onnx.checker.check_model(model, full_check=True)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    return out


class Load:
    """Closed-loop clients sending random (non-zero) rows; counts answers per version."""

    def __init__(self, url: str, concurrency: int = 4) -> None:
        self.client = grpcaio.InferenceServerClient(url)
        self.concurrency = concurrency
        self.answers: list[tuple[float, str]] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _sender(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            inp = grpcaio.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(rng.normal(size=(1, 64)).astype(np.float32))
            try:
                result = await self.client.infer("fraud", [inp], client_timeout=10)
            except InferenceServerException as exc:
                self.errors[str(exc.status())] += 1
                await asyncio.sleep(0.005)
                continue
            self.answers.append((time.monotonic(), result.get_response().model_version))

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._sender(i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    def versions_since(self, t: float) -> collections.Counter[str]:
        return collections.Counter(v for ts, v in self.answers if ts >= t)


@pytest.fixture
async def events(stack) -> AsyncIterator[tuple[Client, list[dict[str, object]]]]:
    assert stack.nats is not None
    nc = await nats.connect(stack.nats.url)
    seen: list[dict[str, object]] = []

    async def on_event(msg) -> None:
        seen.append(json.loads(msg.data))

    await nc.subscribe(Subjects().events("fraud"), cb=on_event)
    await bus.sync(nc)
    try:
        yield nc, seen
    finally:
        await nc.close()


async def _rollout(registry, model: str) -> dict[str, object]:
    return json.loads((await registry.get_rollout(model)).rollout_json)


async def _wait_rollout(registry, model: str, states: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = await _rollout(registry, model)
        if doc["state"] in states:
            return doc
        assert time.monotonic() < deadline, f"rollout still {doc['state']}: {doc['reason']}"
        await asyncio.sleep(0.1)


async def _route(registry, history: int = 0) -> tuple[Route, list[Route]]:
    state = await registry.get_route("fraud", history=history)
    return Route.model_validate_json(state.route_json), [
        Route.model_validate_json(h) for h in state.history_json
    ]


async def _route_where(registry, predicate, timeout: float = 10.0) -> Route:
    deadline = time.monotonic() + timeout
    route, _ = await _route(registry)
    while not predicate(route):
        assert time.monotonic() < deadline, f"route never matched: {route}"
        await asyncio.sleep(0.1)
        route, _ = await _route(registry)
    return route


async def test_failing_canary_is_rolled_back_at_its_first_step(
    stack, events, tmp_path: Path
) -> None:
    from inferbus_client.registry import RegistryClient

    _, seen = events
    broken = write_failing_model(stack.model_dir, tmp_path / "broken")
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(broken, "fraud", "2")
        before, _ = await _route(registry)
        async with Load(stack.grpc_url) as load:
            await registry.start_rollout(
                "fraud",
                "2",
                steps=[10, 50, 100],
                interval_s=30,  # long: the canary can only fail within it
                min_requests=5,
                max_error_rate=0.01,
                ready_timeout_s=60,
                requested_by="e2e",
            )
            done = await _wait_rollout(registry, "fraud", {"rolled_back", "succeeded"}, 90)
            route = await _route_where(registry, lambda r: not r.canary)
            await asyncio.sleep(1.5)  # answers in flight at the rollback may still be v2's
            settled = time.monotonic()
            await asyncio.sleep(1.0)
        print(
            f"answers: {collections.Counter(v for _, v in load.answers)}, "
            f"errors: {dict(load.errors)}, rolled back: {done['reason']}; warm-up "
            f"{(done['ready_unix_ms'] - done['created_unix_ms']) / 1000:.1f}s, judged in "
            f"{(done['updated_unix_ms'] - done['ready_unix_ms']) / 1000:.1f}s"
        )
    assert done["state"] == "rolled_back", done["reason"]
    assert "error rate" in done["reason"] and "step 1 (10%)" in done["reason"]
    assert [h["outcome"] for h in done["history"]] == ["failed"]
    assert done["history"][0]["canary"]["errors"] >= 5
    # Stable untouched, canary gone, and nothing reaches v2 afterwards.
    assert route.stable == "1" and route.canary == "" and route.canary_weight == 0.0
    assert route.revision > before.revision
    assert load.errors, "the failing canary never failed a request"
    assert set(load.versions_since(settled)) == {"1"}, load.versions_since(settled)
    kinds = [e["event"] for e in seen if str(e["event"]).startswith("rollout_")]
    assert kinds[0] == "rollout_started" and kinds[-1] == "rollout_rolled_back"


async def test_healthy_canary_reaches_100_and_leaves_no_stale_route(stack, events) -> None:
    from inferbus_client.registry import RegistryClient

    _, seen = events
    async with RegistryClient(stack.registry_url) as registry:
        await registry.push(stack.model_dir, "fraud", "3")
        before, _ = await _route(registry)
        # Whatever ran before (the rolled-back rollout) left no canary behind.
        assert before.canary == "" and before.canary_weight == 0.0
        async with Load(stack.grpc_url) as load:
            started = json.loads(
                (
                    await registry.start_rollout(
                        "fraud",
                        "3",
                        steps=[25, 100],
                        interval_s=1.0,
                        min_requests=5,
                        # Same model as stable. The p99 of a one-second window on a shared
                        # 2-core runner is its slowest request (seen: 118 ms vs 24 ms), so
                        # the latency check is off here; test_registry_rollout covers it.
                        max_p99_ratio=0.0,
                        ready_timeout_s=60,
                        requested_by="e2e",
                    )
                ).rollout_json
            )
            done = await _wait_rollout(registry, "fraud", {"succeeded", "rolled_back"}, 120)
            route = await _route_where(registry, lambda r: r.stable == "3")
            await asyncio.sleep(1.5)
            settled = time.monotonic()
            await asyncio.sleep(1.0)
        route, history = await _route(registry, history=4)
        steps = done["history"]
        print(
            f"answers: {collections.Counter(v for _, v in load.answers)}, "
            f"errors: {dict(load.errors)}; steps: "
            f"{[(h['weight'], h['canary']['requests'], h['canary']['p99_ms']) for h in steps]}; "
            f"warm-up {(done['ready_unix_ms'] - done['created_unix_ms']) / 1000:.1f}s, steps "
            f"{(done['updated_unix_ms'] - done['ready_unix_ms']) / 1000:.1f}s"
        )
    assert done["state"] == "succeeded", done["reason"]
    assert done["id"] != "" and done["id"] == started["id"]
    assert [h["outcome"] for h in done["history"]] == ["passed", "passed"]
    assert all(h["canary"]["requests"] >= 5 for h in done["history"])
    # Stable moved, no canary or weight left, revisions only grew.
    assert route.stable == "3" and route.aliases["stable"] == "3"
    assert route.canary == "" and route.canary_weight == 0.0
    assert route.revision > before.revision
    revisions = [route.revision] + [h.revision for h in history]
    assert revisions == sorted(revisions, reverse=True)
    changes = [route.change] + [h.change for h in history]
    assert any(f"rollout {done['id']} step 2: weight 100" in c for c in changes), changes
    assert any("promoted to stable" in c for c in changes), changes
    assert not load.errors, load.errors
    assert set(load.versions_since(settled)) == {"3"}, load.versions_since(settled)
    kinds = [
        e["event"]
        for e in seen
        if str(e["event"]).startswith("rollout_") and e.get("rollout_id") == done["id"]
    ]
    assert kinds == ["rollout_started", "rollout_canary_ready", "rollout_step", "rollout_succeeded"]
    assert "route_changed" in {e["event"] for e in seen}


async def test_pool_ledger_and_quota_on_the_stack(stack) -> None:
    import httpx

    from inferbus_client.registry import RegistryClient

    async with RegistryClient(stack.registry_url) as registry:
        route, _ = await _route(registry)
        pools = {p.name: p for p in await registry.list_pools()}
        default = pools["default"]
        assert len(default.workers) == 2, default
        assert all(w.admitted and w.cpus >= 1 and w.memory_bytes > 0 for w in default.workers)
        assert default.total_gpus == sum(w.gpu_count for w in default.workers)
        assert f"fraud/{route.stable}" in default.placed
        assert default.queue_lag >= 0 and not default.configured

        # A quota of 2: a third worker joins, stays not ready and serves nothing.
        await registry.set_pool("default", max_workers=2, updated_by="e2e")
        extra = await asyncio.to_thread(stack.start_worker, "worker-extra")
        try:
            async with httpx.AsyncClient(timeout=2.0) as http:
                deadline = time.monotonic() + 30
                while True:
                    resp = await http.get(extra.readyz_url())
                    if resp.status_code == 503 and "is full" in resp.text:
                        break
                    assert time.monotonic() < deadline, resp.text
                    await asyncio.sleep(0.2)
                assert "max_workers 2" in resp.text
                ledger = {p.name: p for p in await registry.list_pools()}["default"]
                out = [w for w in ledger.workers if not w.admitted]
                assert len(ledger.workers) == 3 and len(out) == 1, ledger
                assert "pool 'default' is full" in out[0].reason
                loaded = [k for k in out[0].models if k.startswith("fraud/")]
                assert not loaded, (out[0], extra.log_tail())

                # Raising the quota lets it in: it loads and turns ready.
                await registry.set_pool("default", max_workers=3, updated_by="e2e")
                await extra.await_ready(timeout=60)
                ledger = {p.name: p for p in await registry.list_pools()}["default"]
                assert all(w.admitted for w in ledger.workers) and ledger.max_workers == 3
        finally:
            await extra.aterminate()
            await registry.set_pool("default", max_workers=0, updated_by="e2e")
