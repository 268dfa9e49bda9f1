"""The ModelInfer pipeline: each step alone, the handler's stages, and their composition.

Real parts where a step has them: admission against a real redis-server, audit
records over a real nats-server, shared memory through real files. The catalog
and the dispatcher behind `Dispatch` are small in-test stand-ins: the handler's
contract with them is a few reads and one call, and the e2e tests run the same
pipeline against the real ones.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.aio.client import Client
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.admission.limits import Limit, Scope, set_limit
from inferbus_common.audit import decode_records
from inferbus_common.catalog import Catalog as LiveCatalog
from inferbus_common.catalog import DeployedVersion, LastWorker, Route, WorkerStatus
from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InferbusError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_common.sequences import SequenceFlags
from inferbus_common.subjects import Subjects
from inferbus_gateway.__main__ import build_pipeline
from inferbus_gateway.admission import Admission, BreakerOpen
from inferbus_gateway.canonical import InferRequest, InferResponse, ShmRef
from inferbus_gateway.dispatch.dispatcher import Reply
from inferbus_gateway.dispatch.idempotency import IdempotencyCache
from inferbus_gateway.dispatch.noworker import NoLiveWorker
from inferbus_gateway.observation.auditbatch import AuditBatches
from inferbus_gateway.pipeline import (
    Admit,
    AuditTrail,
    Dispatch,
    Fallback,
    Idempotency,
    InferCall,
    InferHandler,
    Observers,
    Outcomes,
    Readiness,
    RequestMetrics,
    SharedMemory,
    compose,
)
from inferbus_gateway.settings import GatewaySettings
from inferbus_gateway.triton.sharedmemory import SystemSharedMemory
from inferbus_testing.servers import RedisServer

SUBJECTS = Subjects("ib")


def _config(name: str = "fraud", **extra: object) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "max_batch_size": 8,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "score", "datatype": "FP32", "shape": [-1, 2]},
                {"name": "label", "datatype": "INT64", "shape": [-1]},
            ],
            **extra,
        }
    )


class Catalog(LiveCatalog):
    """The live catalog's lookups (`deployed`, `resolve`) over fixed routes and
    versions, without a bus to watch; every version in state `state`."""

    def __init__(self, *versions: DeployedVersion, state: str = "ready") -> None:
        self.versions = {(dv.model, dv.version): dv for dv in versions}
        self.routes = {
            dv.model: Route(model=dv.model, stable=dv.version, versions=[dv.version])
            for dv in versions
        }
        self.state = state

    def version_state(self, model: str, version: str) -> str:
        return self.state

    def is_ready(self, model: str, version: str) -> bool:
        return self.state == "ready"

    def last_worker(self, model: str, version: str) -> LastWorker | None:
        return None

    def live_workers(self) -> list[WorkerStatus]:
        return []


class Dispatcher:
    """Answers each call with `reply` (or raises `error`) and keeps what it was sent."""

    def __init__(self, reply: Reply | None = None, error: Exception | None = None) -> None:
        self.reply = reply
        self.error = error
        self.calls: list[dict[str, Any]] = []

    async def call(self, envelope: Envelope, tensors: list[Tensor], **kw: Any) -> Reply:
        fields = envelope._asdict()
        self.calls.append({**fields, "tensors": tensors, **kw})
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


def _reply(version: str = "1", rows: int = 1) -> Reply:
    frame = encode_tensors(
        [
            tensor_from_numpy("score", np.full((rows, 2), 0.25, np.float32)),
            tensor_from_numpy("label", np.ones((rows,), np.int64)),
        ]
    )
    return Reply("", version=version, digest="d1", timings_ms={"queue": 0.5}, frame=frame)


def _request(model: str = "fraud", rid: str = "", rows: int = 1, **kw: Any) -> InferRequest:
    x = tensor_from_numpy("x", np.zeros((rows, 4), np.float32))
    return InferRequest(model, "", rid, [x], **kw)


def _handler(catalog: Catalog, dispatcher: Dispatcher, *, sequences: Any = None) -> InferHandler:
    return InferHandler(
        catalog,  # type: ignore[arg-type]
        Dispatch(catalog, dispatcher, sequences),  # type: ignore[arg-type]
        default_timeout_s=5.0,
    )


def _answer(version: str = "1", degraded: str = "") -> InferResponse:
    return InferResponse("fraud", version, "r", [], digest="d1", degraded=degraded)


def _returns(response: InferResponse) -> Any:
    async def handler(call: InferCall) -> InferResponse:
        return response

    return handler


def _raises(exc: Exception) -> Any:
    async def handler(call: InferCall) -> InferResponse:
        raise exc

    return handler


# --- composition -----------------------------------------------------------------


async def test_compose_runs_steps_outermost_first_and_each_once() -> None:
    seen: list[str] = []

    class Mark:
        def __init__(self, name: str) -> None:
            self.name = name

        async def __call__(self, call: InferCall, next_step: Any) -> InferResponse:
            seen.append(f"{self.name}>")
            response = await next_step(call)
            seen.append(f"<{self.name}")
            return response

    async def handler(call: InferCall) -> InferResponse:
        seen.append("handler")
        return _answer()

    pipeline = compose([Mark("a"), Mark("b")], handler)
    await pipeline(InferCall.start(_request(), "grpc"))
    assert seen == ["a>", "b>", "handler", "<b", "<a"]


def test_a_call_gets_an_id_when_the_request_brings_none() -> None:
    mine = InferCall.start(_request(rid="abc"), "grpc")
    made = InferCall.start(_request(), "http")
    assert mine.request_id == "abc"
    assert len(made.request_id) == 32 and made.request_id != InferCall.start(_request(), "http")


# --- the handler: resolve → validate → dispatch → decode ---------------------------


async def test_handler_resolves_validates_dispatches_and_decodes() -> None:
    dv = DeployedVersion(model="fraud", version="1", config=_config(), digest="d0")
    catalog = Catalog(dv)
    catalog.routes["fraud"] = Route(
        model="fraud", stable="1", versions=["1"], sticky="header:X-User"
    )
    dispatcher = Dispatcher(_reply(rows=2))
    call = InferCall.start(_request(rows=2, outputs=["label"]), "grpc", {"x-user": "u7"})
    response = await _handler(catalog, dispatcher)(call)
    assert [t.name for t in response.outputs] == ["label"]
    assert response.outputs[0].as_numpy().tolist() == [1, 1]
    assert (response.version, response.digest, response.id) == ("1", "d1", call.request_id)
    assert call.version == "1" and call.digest == "d1"
    assert {"queue", "gateway", "total"} <= set(response.timings_ms)
    (sent,) = dispatcher.calls
    assert sent["request_id"] == call.request_id and sent["sticky_key"] == "u7"
    assert sent["max_rows"] == 8 and sent["route"] is catalog.routes["fraud"]


async def test_handler_refuses_what_it_cannot_serve() -> None:
    llm = DeployedVersion(model="llm", version="1", config=_config("llm", engine={"kind": "vllm"}))
    dv = DeployedVersion(model="fraud", version="1", config=_config())
    dispatcher = Dispatcher(_reply())
    handler = _handler(Catalog(dv, llm), dispatcher)
    with pytest.raises(NotFound, match="unknown model"):
        await handler(InferCall.start(_request("nope"), "grpc"))
    with pytest.raises(InvalidArgument, match="model name is required"):
        await handler(InferCall.start(_request(""), "grpc"))
    with pytest.raises(InvalidArgument, match="longer than 256"):
        await handler(InferCall.start(_request(rid="i" * 257), "grpc"))
    with pytest.raises(FailedPrecondition, match="generative"):
        await handler(InferCall.start(_request("llm"), "grpc"))
    bad = _request()
    bad.inputs = [Tensor("x", "FP32", (1, 3), b"\0" * 12)]
    with pytest.raises(InvalidArgument):
        await handler(InferCall.start(bad, "grpc"))
    assert dispatcher.calls == []


async def test_handler_raises_the_reply_error_and_refuses_a_malformed_frame() -> None:
    dv = DeployedVersion(model="fraud", version="1", config=_config())
    failed = Dispatcher(
        Reply("RESOURCE_EXHAUSTED", error="queue full", reason="queue", version="1")
    )
    call = InferCall.start(_request(), "grpc")
    with pytest.raises(ResourceExhausted, match="queue full"):
        await _handler(Catalog(dv), failed)(call)
    assert call.version == "1"
    garbled = Dispatcher(Reply("", version="1", frame=b"not a frame"))
    with pytest.raises(Unavailable, match="malformed reply"):
        await _handler(Catalog(dv), garbled)(InferCall.start(_request(), "grpc"))


async def test_readiness_refuses_a_version_that_is_not_ready() -> None:
    dv = DeployedVersion(model="fraud", version="1", config=_config())
    catalog = Catalog(dv, state="loading")
    with pytest.raises(Unavailable):
        await Readiness(catalog).wait(dv, 2.0)  # type: ignore[arg-type]
    catalog.state = "ready"
    assert await Readiness(catalog).wait(dv, 2.0) == 2.0  # type: ignore[arg-type]


async def test_dispatch_refuses_sequences_it_cannot_serve() -> None:
    dv = DeployedVersion(model="fraud", version="1", config=_config())
    dispatcher = Dispatcher(_reply())
    dispatch = Dispatch(Catalog(dv), dispatcher)  # type: ignore[arg-type]
    request = _request(sequence=SequenceFlags(7, start=True))
    with pytest.raises(Unavailable, match="does not serve sequence models"):
        await dispatch.send(InferCall.start(request, "grpc"), dv, 0)
    assert dispatcher.calls == []


# --- the steps ---------------------------------------------------------------------


async def test_admit_sets_the_tenant_refuses_over_limit_and_feeds_the_breaker(
    redis_server: RedisServer,
) -> None:
    keys = AdmissionKeys("pipe")
    admin = connect_redis(redis_server.url)
    _, key = await KeyStore(admin, keys).create_key("acme")
    await set_limit(admin, keys, Limit(Scope.MODEL, "churn", 2, burst=2))
    await admin.aclose()
    settings = GatewaySettings(  # type: ignore[call-arg]
        _env_file=None,
        redis_url=redis_server.url,
        redis_key_prefix="pipe",
        breaker_min_requests=2,
        auth_enabled=True,
        auth_tenant_models={"acme": ["fraud", "churn"]},
    )
    caller = {"x-api-key": key}
    tenants: list[str] = []

    async def handler(call: InferCall) -> InferResponse:
        tenants.append(call.request.tenant)
        raise Unavailable("no worker")

    async with Admission.from_settings(settings, "gw-test") as admission:
        step = Admit(admission)
        for _ in range(2):
            with pytest.raises(Unavailable):
                await step(InferCall.start(_request(), "grpc", caller), handler)
        assert tenants == ["acme", "acme"]  # the authenticated caller's tenant
        # Two failures out of two admitted requests open the model's breaker; it then
        # refuses before the handler (or the limit) is reached.
        with pytest.raises(Unauthenticated):
            await step(InferCall.start(_request(), "grpc"), handler)
        with pytest.raises(BreakerOpen):
            await step(InferCall.start(_request(), "grpc", caller), handler)
        assert len(tenants) == 2
        # Another model, another breaker; its limit (2 requests/s) is hit on the third.
        with pytest.raises(ResourceExhausted) as info:
            for _ in range(3):
                call = InferCall.start(_request("churn"), "grpc", caller)
                await step(call, _returns(_answer()))
        assert info.value.reason == "model-qps"


async def test_shared_memory_step_reads_inputs_and_places_outputs(tmp_path: Path) -> None:
    with open(tmp_path / "io", "wb") as f:
        f.truncate(256)
        f.seek(16)
        f.write(np.arange(4, dtype=np.float32).tobytes())
    regions = SystemSharedMemory(root=tmp_path)
    regions.register("", "io", "/io", 0, 256)
    request = InferRequest(
        "fraud",
        "",
        "",
        [Tensor("x", "FP32", (1, 4), b"")],
        shm_inputs={"x": ShmRef("io", 16, 16)},
        shm_outputs={"score": ShmRef("io", 64, 128)},
    )
    seen: list[bytes] = []

    async def handler(call: InferCall) -> InferResponse:
        seen.append(call.request.inputs[0].data)
        score = tensor_from_numpy("score", np.full((1, 2), 0.5, np.float32))
        return InferResponse("fraud", "1", "", [score])

    response = await SharedMemory(regions)(InferCall.start(request, "grpc"), handler)
    assert np.frombuffer(seen[0], np.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert response.outputs[0].data == b"" and response.shm_outputs["score"].byte_size == 8
    written = (tmp_path / "io").read_bytes()[128:136]
    assert np.frombuffer(written, np.float32).tolist() == [0.5, 0.5]
    regions.close()


async def test_shared_memory_step_refuses_regions_when_not_served() -> None:
    request = _request(shm_inputs={"x": ShmRef("io", 16)})
    with pytest.raises(InvalidArgument, match="not served"):
        await SharedMemory(None)(InferCall.start(request, "grpc"), _returns(_answer()))
    plain = await SharedMemory(None)(InferCall.start(_request(), "grpc"), _returns(_answer()))
    assert plain.version == "1"


async def test_idempotency_step_answers_a_retry_once() -> None:
    computed = 0

    async def handler(call: InferCall) -> InferResponse:
        nonlocal computed
        computed += 1
        return _answer()

    step = Idempotency(IdempotencyCache(30.0))
    first = await step(InferCall.start(_request(rid="r1"), "grpc"), handler)
    again = await step(InferCall.start(_request(rid="r1"), "grpc"), handler)
    assert again == first and again is not first and computed == 1  # a copy of its own
    await step(InferCall.start(_request(), "grpc"), handler)
    await step(InferCall.start(_request(), "grpc"), handler)
    assert computed == 3  # no id: every request is computed


async def test_fallback_answers_load_failures_with_fixed_outputs_only() -> None:
    config = _config(fallback={"outputs": {"score": [0.5, 0.5], "label": [0]}})
    dv = DeployedVersion(model="fraud", version="3", config=config, digest="d3")
    step = Fallback(_handler(Catalog(dv), Dispatcher()))
    call = InferCall.start(_request(rows=2), "grpc")
    answer = await step(call, _raises(Unavailable("no worker")))
    assert answer.degraded == "unavailable" and answer.version == "3" and answer.digest == "d3"
    assert answer.outputs[0].as_numpy().tolist() == [[0.5, 0.5], [0.5, 0.5]]
    limited = await step(call, _raises(ResourceExhausted("full", reason="queue")))
    assert limited.degraded == "queue"
    with pytest.raises(InvalidArgument):
        await step(call, _raises(InvalidArgument("bad input")))  # not a load failure


async def test_a_version_no_worker_serves_is_refused_at_once_or_answered_by_its_fallback() -> None:
    dv = DeployedVersion(model="fraud", version="3", config=_config())
    handler = _handler(Catalog(dv, state="no worker"), Dispatcher())
    with pytest.raises(NoLiveWorker, match="model 'fraud' version '3': no worker serves it"):
        await handler(InferCall.start(_request(), "grpc"))
    config = _config(fallback={"outputs": {"score": [0.5, 0.5], "label": [0]}})
    covered = DeployedVersion(model="fraud", version="3", config=config)
    handler = _handler(Catalog(covered, state="no worker"), Dispatcher())
    answer = await Fallback(handler)(InferCall.start(_request(), "grpc"), handler)
    assert answer.degraded == "no-worker" and answer.version == "3"


async def test_fallback_asks_the_backup_model_once_but_not_on_a_deadline() -> None:
    main = DeployedVersion(model="fraud", version="1", config=_config(fallback={"model": "backup"}))
    backup = DeployedVersion(model="backup", version="9", config=_config("backup"))
    dispatcher = Dispatcher(_reply("9"))
    step = Fallback(_handler(Catalog(main, backup), dispatcher))
    call = InferCall.start(_request(rid="r5"), "http", {"x-user": "u"})
    answer = await step(call, _raises(Unavailable("no worker")))
    assert answer.model == "fraud" and answer.version == "9"
    assert answer.degraded == "unavailable; answered by backup version 9"
    (sent,) = dispatcher.calls
    assert sent["model"] == "backup" and sent["request_id"] == "r5"
    with pytest.raises(DeadlineExceeded):
        await step(call, _raises(DeadlineExceeded("late")))
    assert len(dispatcher.calls) == 1


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_request_metrics_count_each_outcome_by_status() -> None:
    def count(version: str, status: str) -> float:
        labels = {"model": "fraud", "version": version, "protocol": "pm", "status": status}
        return _sample("inferbus_gateway_requests_total", **labels)

    before = {s: count(v, s) for v, s in (("1", "OK"), ("2", "DEGRADED"), ("", "UNAVAILABLE"))}
    timed = _sample("inferbus_gateway_request_duration_seconds_count", model="fraud", protocol="pm")
    step = RequestMetrics()
    await step(InferCall.start(_request(), "pm"), _returns(_answer("1")))
    await step(InferCall.start(_request(), "pm"), _returns(_answer("2", "deadline")))
    with pytest.raises(Unavailable):
        await step(InferCall.start(_request(), "pm"), _raises(Unavailable("x")))
    assert count("1", "OK") == before["OK"] + 1
    assert count("2", "DEGRADED") == before["DEGRADED"] + 1
    assert count("", "UNAVAILABLE") == before["UNAVAILABLE"] + 1
    after = _sample("inferbus_gateway_request_duration_seconds_count", model="fraud", protocol="pm")
    assert after == timed + 1  # only the model's own answer is timed


async def test_audit_trail_records_every_outcome(nats_client: Client) -> None:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await got.put(msg.data)

    await nats_client.subscribe(SUBJECTS.audit_records_all, cb=on_msg)
    await bus.sync(nats_client)
    trail = AuditTrail(AuditBatches(nats_client, SUBJECTS, max_delay_s=0.0), "gw-a")
    ok = InferCall.start(_request(rid="ok"), "grpc")
    await trail(ok, _returns(_answer("1")))
    await trail(InferCall.start(_request(rid="dg"), "grpc"), _returns(_answer("2", "deadline")))
    with pytest.raises(ResourceExhausted):
        await trail(
            InferCall.start(_request(rid="rx"), "http"),
            _raises(ResourceExhausted("full", reason="queue")),
        )
    await trail.close()
    records = []
    while len(records) < 3:
        records += decode_records(await asyncio.wait_for(got.get(), 10.0))
    by_id = {r.request_id: r for r in records}
    assert (by_id["ok"].status, by_id["ok"].version, by_id["ok"].digest) == ("OK", "1", "d1")
    assert (by_id["dg"].status, by_id["dg"].reason) == ("DEGRADED", "deadline")
    assert (by_id["rx"].status, by_id["rx"].reason, by_id["rx"].protocol) == (
        "RESOURCE_EXHAUSTED",
        "queue",
        "http",
    )
    assert all(r.gateway == "gw-a" and r.model == "fraud" for r in records)


async def test_outcomes_show_each_outcome_to_every_recorder_in_order() -> None:
    seen: list[tuple[str, str, str]] = []

    class Keep:
        def __init__(self, name: str) -> None:
            self.name = name

        def failed(self, call: InferCall, exc: InferbusError) -> None:
            seen.append((self.name, call.request.id, exc.code.name))

        def answered(self, call: InferCall, response: InferResponse) -> None:
            seen.append((self.name, call.request.id, response.degraded or "OK"))

    step = Outcomes([Keep("a"), Keep("b")])
    await step(InferCall.start(_request(rid="ok"), "grpc"), _returns(_answer("1")))
    await step(InferCall.start(_request(rid="dg"), "grpc"), _returns(_answer("2", "deadline")))
    with pytest.raises(Unavailable):
        await step(InferCall.start(_request(rid="un"), "grpc"), _raises(Unavailable("x")))
    assert seen == [
        ("a", "ok", "OK"),
        ("b", "ok", "OK"),
        ("a", "dg", "deadline"),
        ("b", "dg", "deadline"),
        ("a", "un", "UNAVAILABLE"),
        ("b", "un", "UNAVAILABLE"),
    ]


async def test_observers_see_model_answers_and_never_fail_them() -> None:
    seen: list[str] = []

    def broken(request: InferRequest, response: InferResponse) -> None:
        raise RuntimeError("observer bug")

    def keep(request: InferRequest, response: InferResponse) -> None:
        seen.append(response.version)

    step = Observers([broken, keep])
    answer = await step(InferCall.start(_request(), "grpc"), _returns(_answer("1")))
    assert answer.version == "1"
    await step(InferCall.start(_request(), "grpc"), _returns(_answer("2", "deadline")))
    assert seen == ["1"]  # a fallback answer is not the model's


async def test_build_pipeline_orders_the_steps_and_leaves_out_those_turned_off(
    nats_client: Client,
) -> None:
    dv = DeployedVersion(model="fraud", version="1", config=_config())
    handler = _handler(Catalog(dv), Dispatcher(_reply()))
    settings = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    async with Admission.from_settings(settings, "gw") as admission:
        full = build_pipeline(
            settings,
            handler,
            nc=nats_client,
            subjects=SUBJECTS,
            instance="gw",
            admission=admission,
            observers=[lambda request, response: None],
            shared_memory=None,
        )
    assert [type(s) for s in full] == [
        Outcomes,
        Observers,
        Fallback,
        Admit,
        SharedMemory,
        Idempotency,
    ]
    assert isinstance(full[0], Outcomes)
    assert [type(r) for r in full[0].recorders] == [AuditTrail, RequestMetrics]
    await full[0].close()
    off = GatewaySettings(  # type: ignore[call-arg]
        _env_file=None, audit_enabled=False, idempotency_window_s=0
    )
    bare = build_pipeline(
        off,
        handler,
        nc=nats_client,
        subjects=SUBJECTS,
        instance="gw",
        admission=None,
        observers=[],
        shared_memory=None,
    )
    assert [type(s) for s in bare] == [Outcomes, Fallback, SharedMemory]
    assert isinstance(bare[0], Outcomes)
    assert [type(r) for r in bare[0].recorders] == [RequestMetrics]
