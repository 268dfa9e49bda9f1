"""Fault injection under steady load: the reliability matrix of issue #11.

A `ChaosStack` is the whole platform as real processes, shaped so that every
fault in the matrix has something to hit: two workers, two gateways, Redis
(with a cluster limit configured, so the gateway really uses it) and the
registry on a real S3 endpoint. `ClosedLoad` keeps a few clients busy, each
request with its own deadline, and records one `Attempt` per request. A
`Fault` breaks something and heals it again; `run_fault` runs one fault under
load and turns the records into a `FaultReport`::

    with ChaosStack(tmp_path) as stack:
        stack.push(model_dir, "fraud")
        stack.wait_model_ready("fraud")
        report = asyncio.run(run_fault(stack, FAULTS["kill-batcher"], Shape.ci()))
        assert report.lost == 0 and report.hung == 0

How a request ends (`Attempt.status`):

* ``OK``: an answer equal to the reference computed in process by onnxruntime;
* ``WRONG``: an answer that is not (counted as lost: the client got garbage);
* a gRPC status name (``DEADLINE_EXCEEDED``, ``UNAVAILABLE``, ...): an
  explicit error the platform sent before the request's deadline;
* ``HANG``: nothing by the deadline plus a grace period (the client's own gRPC
  deadline fired, or the answer came too late to be of use).

The client retries only what `docs/architecture.md` calls safe to retry:
``UNAVAILABLE`` (the request was not computed), on the other gateway first,
within the request's original deadline and with the same request id.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Services are forked from this process while gRPC client threads run; gRPC's
# fork handlers then crash the child (SIGSEGV before exec). We never use gRPC
# in a forked child, so the handlers are not needed. Read when grpc is imported.
# The root conftest.py and scripts/test.sh set it for pytest; this line is for
# bench/reliability.py, which imports this module outside pytest.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from inferbus_testing.processes import ServiceError, ServiceProcess
from inferbus_testing.servers import NatsCluster, S3Server
from inferbus_testing.stack import LocalStack

__all__ = [
    "CLUSTER_FAULTS",
    "FAULTS",
    "SLOW_MODEL",
    "Attempt",
    "ChaosStack",
    "ClosedLoad",
    "ClusterChaosStack",
    "Fault",
    "FaultReport",
    "Shape",
    "environment",
    "make_models",
    "rss_bytes",
    "run_fault",
]

MODEL = "fraud"
INPUT = "input"
OUTPUT = "probabilities"
FEATURES = 64

_PORT_SETTINGS = {"grpc": "GRPC_PORT", "http": "HTTP_PORT", "metrics": "METRICS_PORT"}
_CHANNEL_ARGS = [
    # Reconnect to a restarted gateway within a fraction of a second, not
    # gRPC's default back-off of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# The client's own gRPC deadline says "Deadline Exceeded"; the gateway's says
# "... got no answer before its deadline". Only the second is the platform's.
_CLIENT_DEADLINE_MESSAGE = "deadline exceeded"

log = logging.getLogger(__name__)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, read from ``/proc/<pid>/status`` (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


# --- the stack -------------------------------------------------------------------


class ChaosStack(LocalStack):
    """`LocalStack` with two gateways, Redis with a limit, and the registry on S3.

    Every service can be killed and started again on the ports it had
    (`restart`), the way a supervisor or Kubernetes would bring it back, so
    clients and other services find it where they left it.

    Args:
        base: folder for logs, stores and caches.
        env: extra environment for every service.
        gateways: number of gateway processes.
    """

    model_dir: Path

    def __init__(
        self,
        base: Path,
        *,
        env: dict[str, str] | None = None,
        gateways: int = 2,
        s3: bool = True,
    ):
        super().__init__(base, workers=2, env=env, with_redis=True)
        self.gateway_count = gateways
        self.s3: S3Server | None = S3Server(base / "s3") if s3 else None
        self._specs: dict[str, tuple[str, dict[str, str]]] = {}
        self.start_crashes: list[tuple[str, str]] = []
        """(service, error with log tail) of restarts that crashed while starting."""
        # Children die with the *thread* that forked them (PR_SET_PDEATHSIG), so
        # faults start processes from this one thread, which lives as long as
        # the stack, never from a short-lived executor thread.
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="chaos-spawn")

    def _spawn(self, name: str, module: str, extra: dict[str, str]) -> ServiceProcess:
        self._specs[name] = (module, dict(extra))
        return super()._spawn(name, module, extra)

    @property
    def gateways(self) -> list[ServiceProcess]:
        """Every gateway process, the first one started by `LocalStack`."""
        return [self.gateway] + [self.procs[f"gateway{i}"] for i in range(1, self.gateway_count)]

    @property
    def grpc_urls(self) -> list[str]:
        """gRPC address of every gateway."""
        return [f"127.0.0.1:{g.ports['grpc']}" for g in self.gateways]

    @property
    def http_urls(self) -> list[str]:
        """REST address (host:port) of every gateway."""
        return [f"127.0.0.1:{g.ports['http']}" for g in self.gateways]

    def start(self) -> Self:
        """Start S3 first (the registry stores there), then the stack, then more gateways."""
        self.base.mkdir(parents=True, exist_ok=True)
        if self.s3 is not None:
            self.s3.start()
            bucket = "inferbus"
            client = self.s3.client()
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
            self.env.update(
                {
                    "INFERBUS_REGISTRY_STORE": "s3",
                    "INFERBUS_REGISTRY_S3_ENDPOINT": self.s3.endpoint,
                    "INFERBUS_REGISTRY_S3_ACCESS_KEY": self.s3.access_key,
                    "INFERBUS_REGISTRY_S3_SECRET_KEY": self.s3.secret_key,
                    "INFERBUS_REGISTRY_S3_BUCKET": bucket,
                    # Notice a store that came back within a second, not ten.
                    "INFERBUS_REGISTRY_STORE_PROBE_INTERVAL_S": "1",
                }
            )
        super().start()
        for i in range(1, self.gateway_count):
            self._spawn(
                f"gateway{i}",
                "inferbus_gateway",
                {"INFERBUS_GATEWAY_HTTP_PORT": "0", "INFERBUS_GATEWAY_GRPC_PORT": "0"},
            )
        for proc in self.procs.values():
            proc.wait_ready()
        return self

    def close(self) -> None:
        """Stop everything, S3 last."""
        try:
            super().close()
        finally:
            if self.s3 is not None:
                self.s3.kill()
                self.s3.close()
            self.spawner.shutdown(wait=True)

    def set_cluster_limit(self, qps: float) -> None:
        """Configure a model QPS limit in Redis, so every request goes through the limiter."""
        import redis

        assert self.redis is not None
        # The hash `inferbus limits` writes (see inferbus_gateway.admission.ratelimit).
        client = redis.Redis.from_url(self.redis.url)
        try:
            client.hset("ib:limits", f"model:{MODEL}", f'{{"qps": {qps}}}')
            client.hincrby("ib:limits", "_rev", 1)
        finally:
            client.close()

    def restart(self, name: str, *, ready: bool = True, timeout: float = 30.0) -> ServiceProcess:
        """Start a service again (after a kill or stop) on the ports it had before."""
        old = self.procs[name]
        module, extra = self._specs[name]
        prefix = module.upper() + "_"
        pinned = dict(extra)
        with contextlib.suppress(ServiceError):  # it never got as far as reporting ports
            for port_name, port in old.ports.items():
                if port_name in _PORT_SETTINGS:
                    pinned[prefix + _PORT_SETTINGS[port_name]] = str(port)
        if old.running:
            old.kill()
        try:
            proc = self._spawn(name, module, pinned)
        except ServiceError as exc:
            if "exited with code" not in str(exc):
                raise
            # A crash while starting (seen once: a worker died of SIGSEGV under
            # load) is not what this fault is about: record it with the log
            # (faulthandler prints the native crash's stacks there) and try once more.
            self.start_crashes.append((name, str(exc)))
            log.warning("%s crashed during restart; starting it again: %s", name, exc)
            proc = self._spawn(name, module, pinned)
        self._specs[name] = (module, extra)
        if ready:
            proc.wait_ready(timeout=timeout)
        return proc

    def alive(self) -> dict[str, bool]:
        """Whether each service process (and nats, redis, S3) is running."""
        out = {name: p.running for name, p in self.procs.items()}
        out["nats"] = self.nats is not None and self.nats.running
        out["redis"] = self.redis is not None and self.redis.running
        if self.s3 is not None:
            out["s3"] = self.s3.running
        return out


class ClusterChaosStack(ChaosStack):
    """`ChaosStack` on a NATS cluster: every service is given every node, and the
    work queue, audit stream and catalog buckets keep 3 replicas.

    The registry keeps artifacts in its local store (no S3: this stack is about
    the broker). `cluster` is the `NatsCluster`; `nats` stays None.

    Args:
        base: folder for logs, stores and caches.
        env: extra environment for every service.
        gateways: number of gateway processes.
        nodes: NATS nodes.
    """

    def __init__(
        self,
        base: Path,
        *,
        env: dict[str, str] | None = None,
        gateways: int = 2,
        nodes: int = 3,
    ):
        super().__init__(base, env=env, gateways=gateways, s3=False)
        self.cluster = NatsCluster(base / "nats-cluster", size=nodes)
        self.killed_node: int | None = None
        """The node a cluster fault killed (healed by starting it again)."""

    @property
    def nats_url(self) -> str:
        """Every node's client URL, comma-separated."""
        return self.cluster.url

    def _start_nats(self) -> None:
        self.cluster.start()

    def _stop_nats(self) -> None:
        self.cluster.close()

    def _spawn(self, name: str, module: str, extra: dict[str, str]) -> ServiceProcess:
        replicas = {f"{module.upper()}_JETSTREAM_REPLICAS": "3"}
        return super()._spawn(name, module, {**replicas, **extra})

    def alive(self) -> dict[str, bool]:
        """Whether each service process and each NATS node is running."""
        out = super().alive()
        del out["nats"]
        for node in self.cluster.nodes:
            out[node.server_name] = node.running
        return out


# --- models -----------------------------------------------------------------------


# A model that costs real compute per request, one request per execution: its
# capacity is set by the workers (as on a GPU-bound deployment), so an
# open-loop client on the same machine can offer several times that. Few
# parameters (a fast push), much compute: the 64 features tiled into a
# 320x320 image, two 3x3 convolutions, a mean and a linear layer.
SLOW_MODEL = "slow"
SLOW_SIDE = 320
SLOW_CHANNELS = 32


def build_slow_model() -> onnx.ModelProto:
    """input FP32 [-1, 64] -> ... -> probabilities FP32 [-1, 2], ~950 M MACs per row."""
    rng = np.random.default_rng(7)
    tile = SLOW_SIDE // 8
    c = SLOW_CHANNELS

    def init(name: str, shape: list[int], scale: float = 0.1) -> onnx.TensorProto:
        if name.startswith("s_"):
            return numpy_helper.from_array(np.array(shape, np.int64), name)
        return numpy_helper.from_array(rng.normal(0, scale, shape).astype(np.float32), name)

    inits = [
        init("s_img", [-1, 1, 8, 8]),
        init("s_tile", [1, 1, tile, tile]),
        init("w1", [c, 1, 3, 3]),
        init("w2", [c, c, 3, 3], 0.05),
        init("wf", [c, 2]),
        init("bf", [2]),
    ]
    nodes = [
        helper.make_node("Reshape", ["input", "s_img"], ["img"]),
        helper.make_node("Tile", ["img", "s_tile"], ["big"]),
        helper.make_node("Conv", ["big", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("ReduceMean", ["c2"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("Gemm", ["m", "wf", "bf"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        SLOW_MODEL,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 2])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def make_models(repo: Path, out: Path) -> tuple[Path, Path]:
    """Write the fraud model (the repository's own script) and the slow model."""
    fraud = out / "fraud"
    subprocess.run(
        [sys.executable, str(repo / "examples/fraud/make_model.py"), "--out", str(fraud)],
        check=True,
        capture_output=True,
    )
    slow = out / SLOW_MODEL
    slow.mkdir(parents=True)
    onnx.save_model(build_slow_model(), str(slow / "model.onnx"))
    config = json.loads((fraud / "config.json").read_text())
    config.update(name=SLOW_MODEL, max_batch_size=1, batching={"max_queue_delay_us": 0})
    (slow / "config.json").write_text(json.dumps(config, indent=2))
    return fraud, slow


# --- the load ---------------------------------------------------------------------


@dataclass(slots=True)
class Attempt:
    """One client request from first send to final outcome (times: monotonic seconds)."""

    start: float
    end: float
    status: str
    tries: int = 1
    message: str = ""


class _Reference:
    """The model run in process by onnxruntime: what a correct answer is."""

    def __init__(self, model_dir: Path) -> None:
        import onnxruntime as ort

        self._session = ort.InferenceSession(
            str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
        )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._session.run(None, {INPUT: x})[0]


class ClosedLoad:
    """A few closed-loop clients, each request with its own deadline.

    Args:
        targets: gRPC addresses of the gateways (client k starts at k % n).
        model_dir: the model directory (for the onnxruntime reference).
        concurrency: clients, each with one request in flight.
        deadline_s: each request's deadline, sent as the KServe ``timeout`` parameter.
        grace_s: how long past the deadline an answer may come before it counts as hung.
        retry: retry UNAVAILABLE (safe to retry) on the next gateway within the deadline.
    """

    def __init__(
        self,
        targets: list[str],
        model_dir: Path,
        *,
        concurrency: int = 6,
        deadline_s: float = 2.0,
        grace_s: float = 1.0,
        retry: bool = True,
    ) -> None:
        import tritonclient.grpc.aio as grpcaio

        self._grpcaio = grpcaio
        self._clients = [
            grpcaio.InferenceServerClient(t, channel_args=_CHANNEL_ARGS) for t in targets
        ]
        self._reference = _Reference(model_dir)
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.grace_s = grace_s
        self.retry = retry
        self.attempts: list[Attempt] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self._tasks = [asyncio.create_task(self._client(k)) for k in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Let every client finish its request in flight, then close the channels."""
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks)
            self._tasks = []
        for c in self._clients:
            with contextlib.suppress(Exception):
                await c.close()

    async def _client(self, k: int) -> None:
        rng = np.random.default_rng(k)
        while not self._stop.is_set():
            x = rng.standard_normal((1, FEATURES)).astype(np.float32)
            self.attempts.append(await self.one(k, x))

    async def one(self, k: int, x: np.ndarray) -> Attempt:
        """Send one request (retrying UNAVAILABLE within its deadline) and classify it."""
        from tritonclient.utils import InferenceServerException

        t0 = time.monotonic()
        deadline = t0 + self.deadline_s
        request_id = uuid.uuid4().hex
        tries = 0
        first_error = ""
        n = len(self._clients)
        while True:
            client = self._clients[(k + tries) % n]
            tries += 1
            remaining = deadline - time.monotonic()
            inp = self._grpcaio.InferInput(INPUT, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            try:
                result = await asyncio.wait_for(
                    client.infer(
                        MODEL,
                        [inp],
                        request_id=request_id,
                        timeout=max(1000, int(remaining * 1e6)),
                        client_timeout=remaining + self.grace_s,
                    ),
                    remaining + self.grace_s + 0.5,
                )
            except TimeoutError:
                return Attempt(t0, time.monotonic(), "HANG", tries, "client-side timeout")
            except InferenceServerException as exc:
                status = str(exc.status() or "UNKNOWN").removeprefix("StatusCode.")
                message = exc.message() or ""
                now = time.monotonic()
                if status == "DEADLINE_EXCEEDED" and message.strip().lower().startswith(
                    _CLIENT_DEADLINE_MESSAGE
                ):
                    return Attempt(t0, now, "HANG", tries, message)
                if self.retry and status == "UNAVAILABLE" and deadline - now > 0.05:
                    first_error = first_error or f"retried UNAVAILABLE: {message}"
                    # Safe to retry: not computed. Back off a little, other gateway first.
                    await asyncio.sleep(min(0.05 * tries, max(0.0, deadline - now - 0.05)))
                    continue
                if now > deadline + self.grace_s:
                    return Attempt(t0, now, "HANG", tries, f"late {status}: {message}")
                return Attempt(t0, now, status, tries, message)
            now = time.monotonic()
            if now > deadline + self.grace_s:
                return Attempt(t0, now, "HANG", tries, "late answer")
            got = result.as_numpy(OUTPUT)
            ok = got is not None and np.allclose(got, self._reference(x), rtol=1e-5, atol=1e-6)
            return Attempt(t0, now, "OK" if ok else "WRONG", tries, first_error)


# --- faults -----------------------------------------------------------------------


Action = Callable[[ChaosStack], Awaitable[None]]


@dataclass(frozen=True)
class Fault:
    """Something that breaks (`inject`) and is mended (`heal`) after `hold_s`."""

    name: str
    what: str
    inject: Action
    heal: Action
    hold_s: float = 1.0


def _blocking(fn: Callable[[ChaosStack], Any]) -> Action:
    async def run(stack: ChaosStack) -> None:
        await asyncio.get_running_loop().run_in_executor(stack.spawner, fn, stack)

    return run


async def _nothing(stack: ChaosStack) -> None:
    return None


def _kill(name: str) -> Action:
    return _blocking(lambda s: s.procs[name].kill())


def _restart(name: str) -> Action:
    return _blocking(lambda s: s.restart(name))


def _stop_registry_and_s3(stack: ChaosStack) -> None:
    stack.registry.terminate(timeout=5)
    # Frozen rather than stopped: its port stays open and nothing answers, the
    # harder case for a client (a refused connection fails fast). It also comes
    # back at once, where a SeaweedFS restart takes tens of seconds.
    if stack.s3 is not None and stack.s3.pid is not None:
        os.killpg(stack.s3.pid, signal.SIGSTOP)


def _start_s3_and_registry(stack: ChaosStack) -> None:
    if stack.s3 is not None and stack.s3.pid is not None:
        os.killpg(stack.s3.pid, signal.SIGCONT)
    stack.restart("registry")


def _restart_nats_start(stack: ChaosStack) -> None:
    assert stack.nats is not None
    stack.nats.start()


def _kill_nats(stack: ChaosStack) -> None:
    assert stack.nats is not None
    stack.nats.kill()


def _stop_redis(stack: ChaosStack) -> None:
    assert stack.redis is not None
    stack.redis.stop()


def _start_redis(stack: ChaosStack) -> None:
    assert stack.redis is not None
    stack.redis.start()
    # Redis keeps nothing across a restart (no persistence): put the limit back,
    # as an operator's `inferbus limits` (or a persistent Redis) would.
    stack.set_cluster_limit(1e6)


def _sigstop(name: str) -> Action:
    return _blocking(lambda s: s.procs[name].send_signal(signal.SIGSTOP))


def _sigcont(name: str) -> Action:
    return _blocking(lambda s: s.procs[name].send_signal(signal.SIGCONT))


def _freeze_then_kill(name: str, frozen_s: float = 0.2) -> Action:
    """SIGSTOP `name` (the batches its open pull gets stay with it, un-acked), then
    kill -9 it: it dies holding work in flight."""

    async def run(stack: ChaosStack) -> None:
        stack.procs[name].send_signal(signal.SIGSTOP)
        await asyncio.sleep(frozen_s)
        await asyncio.to_thread(stack.procs[name].kill)

    return run


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "kill-worker",
            "kill -9 one of two workers; restarted after the hold",
            _kill("worker0"),
            _restart("worker0"),
            hold_s=1.0,
        ),
        Fault(
            "kill-busy-worker",
            "kill -9 one of two workers while it holds batches (frozen 0.2 s first); "
            "restarted after the hold",
            _freeze_then_kill("worker0"),
            _restart("worker0"),
            hold_s=1.0,
        ),
        Fault(
            "kill-batcher",
            "kill -9 the only batcher; restarted after the hold",
            _kill("batcher"),
            _restart("batcher"),
            hold_s=1.0,
        ),
        Fault(
            "kill-router",
            "kill -9 the only router; restarted after the hold",
            _kill("router"),
            _restart("router"),
            hold_s=1.0,
        ),
        Fault(
            "kill-gateway",
            "kill -9 one of two gateways (clients fail over); restarted after the hold",
            _kill("gateway"),
            _restart("gateway"),
            hold_s=1.0,
        ),
        Fault(
            "restart-nats",
            "kill -9 nats-server; started again on the same port and JetStream store",
            _blocking(_kill_nats),
            _blocking(_restart_nats_start),
            hold_s=1.0,
        ),
        Fault(
            "restart-redis",
            "stop redis-server (limits fail open); started again",
            _blocking(_stop_redis),
            _blocking(_start_redis),
            hold_s=1.5,
        ),
        Fault(
            "stop-registry-s3",
            "stop the registry, freeze S3 (neither is on the data path); both back after",
            _blocking(_stop_registry_and_s3),
            _blocking(_start_s3_and_registry),
            hold_s=1.5,
        ),
        Fault(
            "sigstop-worker",
            "SIGSTOP one of two workers past its batches' ack wait (0.5 s); SIGCONT after",
            _sigstop("worker0"),
            _sigcont("worker0"),
            hold_s=3.0,
        ),
    ]
}
"""The fault matrix, in the order the report runs it."""


async def _data_path_leaders(cluster: NatsCluster, stream: str) -> tuple[str, set[str]]:
    """(leader of `stream`, leaders of the stream and of each of its consumers)."""
    import nats

    urls = [n.url for n in cluster.nodes if n.running]
    nc = await nats.connect(urls, connect_timeout=2, allow_reconnect=False)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        consumers = await js.consumers_info(stream)
    finally:
        await nc.close()
    assert info.cluster is not None and info.cluster.leader
    leaders = {info.cluster.leader}
    leaders.update(c.cluster.leader for c in consumers if c.cluster and c.cluster.leader)
    return info.cluster.leader, leaders


async def _kill_node(stack: ChaosStack, *, leader: bool) -> None:
    """kill -9 the node that leads the work-queue stream (`leader`), or one that
    leads neither the stream nor its consumers (when there is one); remembered in
    `killed_node` for the heal."""
    from inferbus_common.subjects import Subjects

    assert isinstance(stack, ClusterChaosStack)
    cluster = stack.cluster
    lead, busy = await _data_path_leaders(cluster, Subjects().batch_stream)
    if leader:
        victim = cluster.node(lead)
    else:
        idle = [n for n in cluster.nodes if n.server_name not in busy and n.running]
        others = [n for n in cluster.nodes if n.server_name != lead and n.running]
        victim = (idle or others)[0]
    stack.killed_node = cluster.nodes.index(victim)
    await asyncio.get_running_loop().run_in_executor(stack.spawner, victim.kill)


async def _kill_follower_node(stack: ChaosStack) -> None:
    await _kill_node(stack, leader=False)


async def _kill_batch_leader(stack: ChaosStack) -> None:
    await _kill_node(stack, leader=True)


def _restart_killed_node(stack: ChaosStack) -> None:
    assert isinstance(stack, ClusterChaosStack) and stack.killed_node is not None
    # Back on its ports and store; returns once it is current with the cluster.
    stack.cluster.restart(stack.killed_node)
    stack.killed_node = None


CLUSTER_FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "kill-nats-node",
            "kill -9 one of three NATS nodes (one that leads neither the work queue "
            "nor its consumers); started again after the hold",
            _kill_follower_node,
            _blocking(_restart_killed_node),
            # Longer than a raft election (nats-server waits 4-9 s for a lost
            # leader), so the two nodes left must serve on their own.
            hold_s=12.0,
        ),
        Fault(
            "kill-stream-leader",
            "kill -9 the NATS node that leads the work-queue stream (a new leader "
            "is elected); started again after the hold",
            _kill_batch_leader,
            _blocking(_restart_killed_node),
            # The stream's and its consumers' raft groups each elect a new leader
            # (4-9 s each, randomized; the JetStream meta group too when the node
            # led it) before micro-batches flow again: 6 s in the reliability run,
            # over 12 s once in CI on a loaded machine.
            hold_s=20.0,
        ),
    ]
}
"""Faults of a three-node NATS cluster (`ClusterChaosStack`), in the order the report runs them."""


# --- one run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """How long and how hard one fault run is."""

    concurrency: int = 6
    deadline_s: float = 2.0
    grace_s: float = 1.0
    before_s: float = 1.0
    stable_s: float = 1.0
    after_max_s: float = 15.0

    @classmethod
    def ci(cls) -> Shape:
        """The short variant for the default test run."""
        return cls()

    @classmethod
    def long(cls) -> Shape:
        """The report's variant: more clients, longer before and after."""
        return cls(concurrency=8, before_s=3.0, stable_s=3.0, after_max_s=30.0)


@dataclass
class FaultReport:
    """What happened to the requests sent while one fault came and went."""

    fault: str
    what: str
    load: str
    sent: int
    correct: int
    explicit_errors: dict[str, int]
    wrong: int
    hung: int
    baseline_rps: float
    first_ok_s: float | None
    recovered_s: float | None
    duration_s: float
    retried: int
    in_flight: int = 0
    """Requests in flight when the fault struck (sent, not answered)."""
    in_flight_answered_s: float | None = None
    """When the last of those was answered, seconds after the fault struck."""
    alive: dict[str, bool] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    first_ok_after_fault_s: float | None = None
    """From the fault being in place (e.g. the kill done) to the first correct
    answer to a request sent after it, before any heal."""

    @property
    def explicit(self) -> int:
        """Requests answered with an explicit error before their deadline."""
        return sum(self.explicit_errors.values())

    @property
    def lost(self) -> int:
        """Requests with neither a correct answer, nor an explicit error, nor counted hung."""
        return self.sent - self.correct - self.explicit - self.hung

    def row(self) -> dict[str, Any]:
        """A flat dict for JSON and the markdown table."""
        return {
            "fault": self.fault,
            "what": self.what,
            "load": self.load,
            "sent": self.sent,
            "correct": self.correct,
            "explicit_error": self.explicit,
            "errors": dict(self.explicit_errors),
            "lost": self.lost,
            "wrong": self.wrong,
            "hung": self.hung,
            "first_ok_s": self.first_ok_s,
            "first_ok_after_fault_s": self.first_ok_after_fault_s,
            "recovered_s": self.recovered_s,
            "baseline_rps": round(self.baseline_rps, 1),
            "retried": self.retried,
            "in_flight": self.in_flight,
            "in_flight_answered_s": self.in_flight_answered_s,
            "duration_s": round(self.duration_s, 2),
            "alive": self.alive,
        }


def _all_ok_since(attempts: list[Attempt], since: float, until: float) -> bool:
    window = [a for a in attempts if a.start >= since and a.end <= until]
    return bool(window) and all(a.status == "OK" for a in window)


async def run_fault(stack: ChaosStack, fault: Fault, shape: Shape) -> FaultReport:
    """Run `fault` under closed-loop load and measure what the clients saw.

    Recovery: after `heal`, the load goes on until every request of the last
    `stable_s` seconds was answered correctly (or `after_max_s` passes).
    ``first_ok_s`` is the time from the heal to the first correct answer;
    ``recovered_s`` the time from the heal to the start of the run of correct
    answers that lasts to the end (0 when nothing failed after the heal).
    """
    load = ClosedLoad(
        stack.grpc_urls,
        stack.model_dir,
        concurrency=shape.concurrency,
        deadline_s=shape.deadline_s,
        grace_s=shape.grace_s,
    )
    t_begin = time.monotonic()
    async with load:
        await asyncio.sleep(shape.before_s)
        t_fault = time.monotonic()
        before = [a for a in load.attempts if a.end <= t_fault]
        await fault.inject(stack)
        t_broken = time.monotonic()  # the fault is in place (a kill has returned)
        await asyncio.sleep(fault.hold_s)
        await fault.heal(stack)
        t_heal = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if now - t_heal >= shape.stable_s and _all_ok_since(
                load.attempts, now - shape.stable_s, now
            ):
                break
            if now - t_heal >= shape.after_max_s:
                break
    t_end = time.monotonic()
    attempts = load.attempts
    counts = collections.Counter(a.status for a in attempts)
    errors = {k: v for k, v in counts.items() if k not in ("OK", "WRONG", "HANG")}
    first_ok = [a.end for a in attempts if a.status == "OK" and a.end >= t_heal]
    first_ok_after_fault = [a.end for a in attempts if a.status == "OK" and a.start >= t_broken]
    bad_after = [a.start for a in attempts if a.status != "OK" and a.end >= t_fault]
    recovered: float | None
    if not _all_ok_since(attempts, t_end - shape.stable_s, t_end):
        recovered = None
    elif not bad_after or max(bad_after) < t_heal:
        recovered = 0.0
    else:
        recovered = max(bad_after) - t_heal
    samples = sorted({f"{a.status}: {a.message[:160]}" for a in attempts if a.message})
    caught = [a for a in attempts if a.start < t_broken < a.end]
    return FaultReport(
        fault=fault.name,
        what=fault.what,
        load=(
            f"closed loop, {shape.concurrency} clients over {len(stack.gateways)} gateways, "
            f"deadline {shape.deadline_s:g} s"
        ),
        sent=len(attempts),
        correct=counts["OK"],
        explicit_errors=errors,
        wrong=counts["WRONG"],
        hung=counts["HANG"],
        baseline_rps=len(before) / max(1e-9, t_fault - t_begin),
        first_ok_s=round(min(first_ok) - t_heal, 3) if first_ok else None,
        recovered_s=round(recovered, 3) if recovered is not None else None,
        duration_s=t_end - t_begin,
        retried=sum(1 for a in attempts if a.tries > 1),
        in_flight=len(caught),
        in_flight_answered_s=(round(max(a.end for a in caught) - t_broken, 3) if caught else None),
        alive=stack.alive(),
        samples=samples[:12],
        first_ok_after_fault_s=(
            round(min(first_ok_after_fault) - t_broken, 3) if first_ok_after_fault else None
        ),
    )


def environment() -> dict[str, str]:
    """The stack environment the fault matrix needs (the product's own ack wait, 0.5 s)."""
    return {
        # The breaker would turn a burst of failures during a fault into seconds of
        # refusals after it; the matrix measures the platform's recovery, not the
        # breaker's hold time (which has its own tests).
        "INFERBUS_GATEWAY_BREAKER_ENABLED": "false",
        # The work queue of a model holds what its workers drain well within a
        # deadline; more would only wait and expire (overload tests).
        "INFERBUS_BATCHER_STREAM_MAX_MSGS_PER_SUBJECT": "32",
    }


_Stack = TypeVar("_Stack", bound=ChaosStack)


@contextlib.contextmanager
def ready_stack(
    stack_class: type[_Stack], repo: Path, base: Path, *, with_slow: bool = False
) -> Iterator[_Stack]:
    """A started `stack_class` under `base` with a (high) cluster limit in Redis and
    the fraud model ready (and `SLOW_MODEL` with `with_slow`); stopped on exit."""
    fraud, slow = make_models(repo, base / "models")
    stack = stack_class(base / "stack", env=environment())
    stack.model_dir = fraud
    with stack:
        stack.set_cluster_limit(1e6)
        stack.push(fraud, "fraud")
        if with_slow:
            stack.push(slow, SLOW_MODEL)
        stack.wait_model_ready("fraud")
        if with_slow:
            stack.wait_model_ready(SLOW_MODEL)
        yield stack
