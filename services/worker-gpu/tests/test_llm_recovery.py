"""A version server recovers from a dead vLLM engine (real nats-server).

vLLM is not installed in the workspace environment, so `ScriptedEngine` (an
`LlmEngine` whose start, death and steps the test drives) stands in for it; the
bus is real. The same recovery against a real vLLM engine whose core process is
SIGKILLed is tested in tests/e2e/test_e2e_llm.py.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.catalog import Catalog, DeployedVersion, Route, WorkerStatus, ensure_kv
from inferbus_common.generation import GenerationChunk, GenerationRequest
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects, subject_token
from inferbus_router.prefix import PlacedForwarder, PrefixTable
from inferbus_router.router import Router
from inferbus_testing.busdebug import lost_request_report
from inferbus_testing.servers import NatsServer
from inferbus_worker.llm.engine import EngineDead, LlmEngine, Step
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.llm.supervision import DEAD_GRACE_S, RESTARTING
from inferbus_worker.llm.versionserver import VersionServer

_models = itertools.count()


@dataclass
class Script:
    """What every `ScriptedEngine` made from one original does (shared by its copies)."""

    failing_starts: int = 0
    """Starts that raise before one succeeds."""
    hang_when_dead: bool = False
    """A dead engine's requests hang instead of raising (vLLM raises at once)."""
    start_gate: threading.Event = field(default_factory=threading.Event)
    """A start waits for it (set by default: starts do not wait)."""
    starts: int = 0
    shutdowns: int = 0

    def __post_init__(self) -> None:
        self.start_gate.set()


class ScriptedEngine(LlmEngine):
    """An `LlmEngine` without vLLM: one token per 10 ms until `kill`."""

    script: Script

    def fresh(self) -> ScriptedEngine:
        copy = ScriptedEngine(self.config, self.model_dir, self.device)
        copy.script = self.script
        return copy

    def start(self) -> None:
        self.script.starts += 1
        self.script.start_gate.wait(10)
        if self.script.failing_starts:
            self.script.failing_starts -= 1
            raise RuntimeError("CUDA out of memory")
        self._killed = asyncio.Event()
        self._llm = self  # started

    def kill(self) -> None:
        """What SIGKILL of vLLM's engine-core process does to the engine."""
        self._killed.set()

    @property
    def dead(self) -> bool:
        return self._llm is not None and self._killed.is_set()

    def render(self, request: GenerationRequest) -> list[int]:
        return [1, 2, 3]

    async def generate(
        self, request_id: str, request: GenerationRequest, prompt_ids: list[int]
    ) -> AsyncIterator[Step]:
        if self.dead:
            raise EngineDead()
        for i in range(request.max_tokens or 3):
            try:
                async with asyncio.timeout(0.01):
                    await self._killed.wait()
            except TimeoutError:
                last = i + 1 == (request.max_tokens or 3)
                yield Step("x", 1, "length" if last else None, len(prompt_ids), done=last)
                continue
            if self.script.hang_when_dead:
                await asyncio.Event().wait()
            raise EngineDead()

    def shutdown(self, timeout_s: float | None = None) -> None:
        if self._llm is not None:
            self._llm = None
            self.script.shutdowns += 1


def _config() -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "tiny",
            "platform": "vllm",
            "file": "hf/config.json",
            "max_batch_size": 0,
            "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}],
            "engine": {"kind": "vllm"},
            "generation": {"max_num_seqs": 2, "max_waiting": 2},
        }
    )


@dataclass
class Rig:
    """A started server, its engine, and what its hooks were told."""

    nc: Client
    subjects: Subjects
    server: VersionServer
    engine: ScriptedEngine
    states: list[str]
    fatal: list[str]

    @property
    def model(self) -> str:
        return self.server.dv.model


async def _rig(
    nats_url: str, tmp_path: Path, script: Script, attempts: int = 3, worker_id: str = ""
) -> Rig:
    nc = await nats.connect(nats_url)
    subjects = Subjects(f"rc{next(_models)}")
    dv = DeployedVersion(model=f"m{next(_models)}", version="1", config=_config())
    engine = ScriptedEngine(dv.config, tmp_path, "cpu")
    engine.script = script
    engine.start()
    settings = LlmWorkerSettings(
        nats_url=nats_url,
        cache_dir=tmp_path,
        device="cpu",
        load_retry_s=0.05,
        engine_restart_attempts=attempts,
        engine_shutdown_timeout_s=1.0,
    )
    states: list[str] = []
    fatal: list[str] = []
    server = VersionServer(
        nc, subjects, dv, engine, settings, states.append, fatal.append, worker_id=worker_id
    )
    await server.start()
    return Rig(nc, subjects, server, engine, states, fatal)


class Call:
    """One generation request over the bus; collects its chunks."""

    def __init__(
        self, rig: Rig, rid: str, max_tokens: int = 3, deadline_s: float | None = None
    ) -> None:
        self.rig = rig
        self.rid = rid
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.msgs: list[Msg] = []
        self.final = asyncio.Event()

    async def _listen(self, client: Client) -> str:
        """A fresh inbox on `client` whose chunks this call collects."""
        inbox = client.new_inbox()

        async def on_chunk(msg: Msg) -> None:
            self.msgs.append(msg)
            if (msg.headers or {}).get(h.FINAL) == "1":
                self.final.set()

        await client.subscribe(inbox, cb=on_chunk)
        return inbox

    async def send(self) -> Call:
        inbox = await self._listen(self.rig.nc)
        body = GenerationRequest(kind="completion", prompt="p", max_tokens=self.max_tokens)
        headers = {h.REPLY: inbox, h.REQUEST_ID: self.rid}
        if self.deadline_s is not None:
            headers[h.DEADLINE] = str(h.deadline_from_timeout(self.deadline_s))
        await self.rig.nc.publish(
            self.rig.subjects.gen(self.rig.model, "1"), body.encode(), headers=headers
        )
        await bus.sync(self.rig.nc)
        return self

    @property
    def finals(self) -> list[dict[str, str]]:
        return [m.headers or {} for m in self.msgs if (m.headers or {}).get(h.FINAL) == "1"]

    async def wait_final(self, timeout: float = 5.0) -> dict[str, str]:
        async with asyncio.timeout(timeout):
            await self.final.wait()
        await asyncio.sleep(0.1)  # a second final chunk would arrive by now
        assert len(self.finals) == 1, self.finals
        return self.finals[0]


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_dead_engine_fails_in_flight_once_refuses_then_serves_again(
    nats_url: str, tmp_path: Path
) -> None:
    script = Script()
    rig = await _rig(nats_url, tmp_path, script)
    try:
        labels = {"model": rig.model, "version": "1"}
        long = await Call(rig, "long", max_tokens=1000).send()
        await wait_until(lambda: len(long.msgs) >= 2)

        script.start_gate.clear()  # hold the restart: the server must refuse meanwhile
        rig.engine.kill()
        final = await long.wait_final()
        assert final[h.STATUS] == "UNAVAILABLE"
        assert "the vLLM engine died; retry" in final[h.ERROR]
        await wait_until(lambda: rig.states == [RESTARTING])
        assert rig.server.down

        t0 = time.monotonic()
        refused = await (await Call(rig, "during").send()).wait_final()
        assert time.monotonic() - t0 < 2.0, "refused at once, not after the restart"
        assert refused[h.STATUS] == "UNAVAILABLE"
        assert "the vLLM engine died; retry" in refused[h.ERROR]

        script.start_gate.set()
        await wait_until(lambda: rig.states == [RESTARTING, "ready"])
        assert not rig.server.down and not rig.fatal
        assert rig.server.engine is not rig.engine and script.shutdowns == 1
        assert _sample("inferbus_llm_engine_restarts_total", **labels, result="ok") == 1
        assert _sample("inferbus_llm_requests_total", **labels, status="UNAVAILABLE") == 2

        served = await Call(rig, "after").send()
        assert h.STATUS not in await served.wait_final()
        last = GenerationChunk.decode(served.msgs[-1].data)
        assert (last.finish_reason, last.completion_tokens) == ("length", 3)
    finally:
        await rig.server.stop(1.0)
        await rig.nc.close()


async def test_hung_requests_are_cancelled_and_failed_restarts_are_fatal(
    nats_url: str, tmp_path: Path
) -> None:
    """The health poll finds the engine dead while a request hangs in it; three
    restarts fail in a row: the server gives up through its fatal hook."""
    script = Script(hang_when_dead=True)
    rig = await _rig(nats_url, tmp_path, script, attempts=3)
    script.failing_starts = 3
    try:
        labels = {"model": rig.model, "version": "1"}
        hung = await Call(rig, "hung", max_tokens=1000).send()
        await wait_until(lambda: len(hung.msgs) >= 2)
        rig.engine.kill()
        rig.server.check_engine()  # what the worker's 0.25 s poll does
        rig.server.check_engine()  # twice: still one recovery
        final = await hung.wait_final(timeout=DEAD_GRACE_S + 3)
        assert final[h.STATUS] == "UNAVAILABLE"
        assert "the vLLM engine died; retry" in final[h.ERROR]
        assert _sample("inferbus_llm_aborted_total", **labels, why="engine-dead") == 1

        await wait_until(lambda: bool(rig.fatal))
        assert script.starts == 1 + 3
        assert len(rig.fatal) == 1 and "3 restarts in a row failed" in rig.fatal[0]
        assert "CUDA out of memory" in rig.fatal[0]
        assert rig.states[0] == RESTARTING
        assert rig.states[1].startswith(f"{RESTARTING}; restart 1 of 3 failed")
        assert rig.states[-1] == f"failed: {rig.fatal[0]}"
        assert _sample("inferbus_llm_engine_restarts_total", **labels, result="failed") == 3
        assert _sample("inferbus_llm_engine_restarts_total", **labels, result="ok") == 0

        refused = await (await Call(rig, "later").send()).wait_final()
        assert refused[h.STATUS] == "UNAVAILABLE"
        assert "3 restarts in a row failed" in refused[h.ERROR]
    finally:
        await rig.server.stop(1.0)
        await rig.nc.close()


# --- admission across workers ---------------------------------------------------------
async def _twin(rig: Rig, nats_url: str, tmp_path: Path, worker_id: str = "") -> VersionServer:
    """A second worker's server for the same version (own connection, own engine)."""
    nc = await nats.connect(nats_url)
    engine = ScriptedEngine(rig.server.dv.config, tmp_path, "cpu")
    engine.script = Script()
    engine.start()
    settings = LlmWorkerSettings(nats_url=nats_url, cache_dir=tmp_path, device="cpu")
    server = VersionServer(nc, rig.subjects, rig.server.dv, engine, settings, worker_id=worker_id)
    await server.start()
    return server


class Routed(Call):
    """A request sent as the router sends it: from another connection, with a NATS
    reply subject on which that connection gets nats-server's "no responders"."""

    def __init__(self, rig: Rig, client: Client, rid: str) -> None:
        super().__init__(rig, rid, max_tokens=1000)
        self.client = client

    async def send(self) -> Routed:
        inbox = await self._listen(self.client)
        body = GenerationRequest(kind="completion", prompt="p", max_tokens=self.max_tokens)
        await self.client.publish(
            self.rig.subjects.gen(self.rig.model, "1"),
            body.encode(),
            reply=f"nr.{self.rid}",
            headers={h.REPLY: inbox, h.REQUEST_ID: self.rid},
        )
        return self


async def _router_connection(nats_url: str) -> tuple[Client, asyncio.Queue[Msg]]:
    """The router's side: a connection and the "no responders" it receives."""
    client = await nats.connect(nats_url)
    no_responders: asyncio.Queue[Msg] = asyncio.Queue()
    await client.subscribe("nr.>", cb=no_responders.put)
    await bus.sync(client)
    return client, no_responders


async def test_full_workers_leave_the_queue_group_so_none_refuses_while_another_has_room(
    nats_url: str, tmp_path: Path
) -> None:
    """Two workers, bound 4 each: 8 requests in a burst are all admitted (a plain
    queue group splits 8 requests 4/4 only 70 times in 256; other splits refused
    some); the 9th finds nobody subscribed ("no responders", which the router turns
    into 429); a slot that frees takes the next request."""
    rig = await _rig(nats_url, tmp_path, Script())
    twin = await _twin(rig, nats_url, tmp_path)
    servers = [rig.server, twin]
    client, no_responders = await _router_connection(nats_url)
    try:
        labels = {"model": rig.model, "version": "1"}
        calls = [await Routed(rig, client, f"r{i}").send() for i in range(8)]
        await bus.sync(client)
        await wait_until(lambda: all(len(c.msgs) >= 1 for c in calls))
        assert not any(c.finals for c in calls), [c.finals for c in calls]
        assert [s.in_flight for s in servers] == [4, 4]
        await wait_until(lambda: not any(s.taking_requests for s in servers))
        assert _sample("inferbus_llm_rejected_total", **labels) == 0
        assert no_responders.empty()

        extra = await Routed(rig, client, "extra").send()
        refused = await asyncio.wait_for(no_responders.get(), 5)
        assert refused.subject == "nr.extra"
        assert (refused.headers or {}).get("Status") == "503"
        await asyncio.sleep(0.1)
        assert not extra.msgs, "nobody took it"

        assert twin.cancel("r0", "cancelled") or rig.server.cancel("r0", "cancelled")
        await wait_until(lambda: any(s.taking_requests for s in servers))
        later = await Routed(rig, client, "later").send()
        await wait_until(lambda: len(later.msgs) >= 1)
        assert not later.finals and no_responders.empty()
        assert sorted(s.in_flight for s in servers) == [4, 4]
    finally:
        await asyncio.gather(rig.server.stop(1.0), twin.stop(1.0))
        await asyncio.gather(rig.nc.close(), twin._nc.close(), client.close())


async def test_a_burst_beyond_the_bound_is_refused_once_each_at_once(
    nats_url: str, tmp_path: Path
) -> None:
    """One worker, bound 4, 6 requests at once: 4 run; each of the other 2 gets
    exactly one refusal at once: "no responders" to the router when it arrived
    after the worker withdrew, else (it was handed on and nobody had room) a
    RESOURCE_EXHAUSTED ``llm-full`` from the worker."""
    rig = await _rig(nats_url, tmp_path, Script())
    client, no_responders = await _router_connection(nats_url)
    try:
        labels = {"model": rig.model, "version": "1"}
        calls = [await Routed(rig, client, f"b{i}").send() for i in range(6)]
        await bus.sync(client)
        await wait_until(lambda: sum(1 for c in calls if c.msgs) + no_responders.qsize() == 6)
        await asyncio.sleep(0.2)  # a second answer to anyone would be in by now
        running = [c for c in calls if c.msgs and not c.finals]
        refused = [c for c in calls if c.finals]
        assert len(running) == 4 and rig.server.in_flight == 4
        assert not rig.server.taking_requests
        for call in refused:
            assert len(call.msgs) == 1
            assert call.finals[0][h.STATUS] == "RESOURCE_EXHAUSTED"
            assert call.finals[0][h.REASON] == "llm-full"
            assert "every worker serving it holds as many requests" in call.finals[0][h.ERROR]
        unanswered = {c.rid for c in calls if not c.msgs}
        nr = {no_responders.get_nowait().subject for _ in range(no_responders.qsize())}
        assert nr == {f"nr.{rid}" for rid in unanswered}
        assert len(refused) + len(nr) == 2
        handed = _sample("inferbus_llm_handed_off_total", **labels)
        assert _sample("inferbus_llm_rejected_total", **labels) == len(refused) <= handed
        print(f"refused by the worker after a hand-off: {len(refused)}, no responders: {len(nr)}")
    finally:
        await rig.server.stop(1.0)
        await asyncio.gather(rig.nc.close(), client.close())


# --- prefix-aware placement (the router's side: inferbus_router.prefix) ---------------
class Placed(Call):
    """A completion sent to the router (``ib.genroute``), as the gateway sends it."""

    def __init__(self, rig: Rig, client: Client, rid: str, prompt: str) -> None:
        super().__init__(rig, rid, max_tokens=1000)
        self.client = client
        self.prompt = prompt

    async def send(self) -> Placed:
        inbox = await self._listen(self.client)
        body = GenerationRequest(kind="completion", prompt=self.prompt, max_tokens=1000)
        await self.client.publish(
            self.rig.subjects.gen_route(self.rig.model),
            body.encode(),
            headers={
                h.MODEL: self.rig.model,
                h.KIND: h.KIND_GENERATE,
                h.REQUEST_ID: self.rid,
                h.REPLY: inbox,
            },
        )
        return self


async def test_the_router_places_a_shared_prefix_on_one_worker_while_it_has_a_free_slot(
    nats_url: str, module_nats_server: NatsServer, tmp_path: Path
) -> None:
    """Two workers (2 running slots, bound 4 each) behind a real router with prefix
    placement: every request sharing a prompt prefix runs on the worker that got
    the first; with that worker's running slots full the next goes to the queue
    group (answered, counted as a fallback); distinct prefixes spread over both."""
    rig = await _rig(nats_url, tmp_path, Script(), worker_id="w1")
    twin = await _twin(rig, nats_url, tmp_path, worker_id="w2")
    servers = {"w1": rig.server, "w2": twin}
    model = rig.model
    js = rig.nc.jetstream()
    workers_kv = await ensure_kv(js, rig.subjects.workers_bucket)
    for wid in servers:
        status = WorkerStatus(
            worker_id=wid,
            pool="default",
            models={f"{model}/1": "ready"},
            ts_ms=int((time.time() + 600) * 1000),
        )
        await workers_kv.put(subject_token(wid), status.model_dump_json().encode())
    routes_kv = await ensure_kv(js, rig.subjects.routes_bucket)
    route = Route(model=model, stable="1", versions=["1"])
    await routes_kv.put(Subjects.model_key(model), route.model_dump_json().encode())
    router_errors: list[Exception] = []

    async def on_router_error(exc: Exception) -> None:
        router_errors.append(exc)

    router_nc = await nats.connect(nats_url, name="router", error_cb=on_router_error)
    client = await nats.connect(nats_url)
    forwarder = PlacedForwarder(router_nc, rig.subjects, PrefixTable(64))
    labels = {"model": model, "version": "1"}

    def where(rid: str) -> str:
        return next((w for w, s in servers.items() if rid in s._tasks), "")

    async def run(rid: str, prompt: str) -> str:
        call = await Placed(rig, client, rid, prompt).send()
        try:
            await wait_until(lambda: len(call.msgs) >= 1, timeout=30)
        except AssertionError:
            # Where it is (a worker's tasks, the forwarder's fallbacks), what the
            # router's connection reported, and who holds which subscription.
            held = {w: list(s._tasks) for w, s in servers.items()}
            raise AssertionError(
                f"{rid}: no chunk in 30 s; workers hold {held}; forwarder holds "
                f"{forwarder.holding}; router errors {router_errors}; "
                f"{lost_request_report(module_nats_server, rig.subjects.gen_route(model), router)}"
            ) from None
        assert not call.finals, call.finals
        await wait_until(lambda: bool(where(rid)), timeout=30)
        return where(rid)

    def stop_all() -> None:
        for server in servers.values():
            for rid in list(server._tasks):
                server.cancel(rid, "cancelled")

    try:
        async with Catalog(router_nc.jetstream(), rig.subjects) as catalog:
            await catalog.wait_loaded()
            assert await catalog.wait_for(
                lambda: len(catalog.ready_workers(model, "1")) == 2 and model in catalog.routes,
                10,
            )
            router = Router(router_nc, catalog, rig.subjects, "router", placement=forwarder)
            await router.start()
            try:
                await wait_until(lambda: all(s.taking_placed for s in servers.values()))
                shared = "You are a terse assistant. " * 10  # 270 characters: 4 blocks
                holder = await run("p0", shared + "first question")
                stop_all()
                for i in range(1, 6):
                    await wait_until(lambda: servers[holder].taking_placed)
                    assert await run(f"p{i}", shared + f"question {i}") == holder
                    stop_all()
                assert (
                    _sample("inferbus_router_prefix_placements_total", **labels, outcome="new") == 1
                )
                assert (
                    _sample("inferbus_router_prefix_placements_total", **labels, outcome="hit") == 5
                )

                # The holder's two running slots taken: it leaves its placement subject,
                # and the next request of the prefix goes to the queue group.
                await wait_until(lambda: servers[holder].in_flight == 0)
                await wait_until(lambda: servers[holder].taking_placed)
                assert await run("f0", shared + "a") == holder
                assert await run("f1", shared + "b") == holder
                await wait_until(lambda: not servers[holder].taking_placed)
                assert await run("f2", shared + "c") in servers
                fallback = "inferbus_router_prefix_placements_total"
                assert _sample(fallback, **labels, outcome="fallback") == 1
                stop_all()

                # Prefixes no one holds spread (rendezvous hashing of the first block).
                seen = set()
                for i in range(12):
                    await wait_until(lambda: all(s.in_flight == 0 for s in servers.values()))
                    await wait_until(lambda: all(s.taking_placed for s in servers.values()))
                    seen.add(await run(f"d{i}", f"topic {i:02d} " * 12))
                    stop_all()
                assert seen == {"w1", "w2"}
                assert forwarder.holding <= 20
            finally:
                await router.drain()
    finally:
        stop_all()
        await asyncio.gather(rig.server.stop(1.0), twin.stop(1.0))
        await asyncio.gather(rig.nc.close(), twin._nc.close(), client.close(), router_nc.close())


# --- admission by deadline (inferbus_worker.llm.capacity) -----------------------------
async def test_a_request_that_would_end_past_its_deadline_is_refused_at_once(
    nats_url: str, tmp_path: Path
) -> None:
    """Two running slots (one token per 10 ms). With both taken, a request that must
    wait and asks for 1000 tokens (~10 s) with 2 s left is refused 429 ``llm-late``
    at once with a retry hint; a short one with time to spare waits and is served;
    with a slot free nothing is refused whatever its deadline."""
    rig = await _rig(nats_url, tmp_path, Script())
    server = rig.server
    labels = {"model": rig.model, "version": "1"}
    try:
        # Nothing is known before the first request ends: everything is admitted.
        assert not server.capacity.known
        for i in range(2):
            assert (
                h.STATUS
                not in await (await Call(rig, f"warm{i}", max_tokens=5).send()).wait_final()
            )
        assert server.capacity.known
        assert 0.005 < server.capacity.per_token_s < 0.2

        longs = [await Call(rig, f"long{i}", max_tokens=1000).send() for i in range(2)]
        await wait_until(lambda: server.in_flight == 2 and all(c.msgs for c in longs))
        t0 = time.monotonic()
        late = await Call(rig, "late", max_tokens=1000, deadline_s=2.0).send()
        final = await late.wait_final()
        assert time.monotonic() - t0 < 1.0, "refused at once, not at its deadline"
        assert final[h.STATUS] == "RESOURCE_EXHAUSTED", final
        assert final[h.REASON] == "llm-late"
        assert "would end after its deadline" in final[h.ERROR]
        assert float(final[h.RETRY_AFTER]) >= 1.0
        assert _sample("inferbus_llm_refused_late_total", **labels) == 1

        fits = await Call(rig, "fits", max_tokens=3, deadline_s=60.0).send()
        await wait_until(lambda: server.in_flight == 3)
        assert not fits.finals, "it waits for a slot"
        assert server.cancel("long0", "cancelled")
        assert h.STATUS not in await fits.wait_final()

        # A free slot: it starts now, so it is never refused for its deadline.
        await wait_until(lambda: server.in_flight == 1)
        now = await (await Call(rig, "now", max_tokens=1000, deadline_s=0.5).send()).wait_final()
        assert now[h.STATUS] == "DEADLINE_EXCEEDED", now
        assert _sample("inferbus_llm_refused_late_total", **labels) == 1
    finally:
        await server.stop(1.0)
        await rig.nc.close()
