"""The chaos stack: the platform as real processes shaped for the fault matrix, its
models, and a ready-to-use stack (`ready_stack`)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from inferbus_testing.edge import edge_process
from inferbus_testing.examples import make_fraud_model
from inferbus_testing.processes import ServiceError, ServiceProcess
from inferbus_testing.servers import NatsCluster, S3Server
from inferbus_testing.stack import LocalStack

MODEL = "fraud"
INPUT = "input"
OUTPUT = "probabilities"
FEATURES = 64

EDGE = "inferbus_edge"
"""The edge's name as a module: its settings are ``INFERBUS_EDGE_*``."""
_PORT_SETTINGS = {"grpc": "GRPC_PORT", "http": "HTTP_PORT", "metrics": "METRICS_PORT"}

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
        edge: also start ``inferbus-edge`` in front of the gateways (``edge_url``);
            it is a service like the others (``procs["edge"]``, `restart`).
    """

    model_dir: Path

    def __init__(
        self,
        base: Path,
        *,
        env: dict[str, str] | None = None,
        gateways: int = 2,
        s3: bool = True,
        edge: bool = False,
    ):
        super().__init__(base, workers=2, env=env, with_redis=True)
        self.gateway_count = gateways
        self.with_edge = edge
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
        if module != EDGE:
            return super()._spawn(name, module, extra)
        # The compiled edge: its settings without the prefix, its upstream (streams)
        # the first gateway; unary calls reach every gateway over NATS.
        settings = {k.removeprefix(EDGE.upper() + "_"): v for k, v in extra.items()}
        proc = edge_process(self.nats_url, self.grpc_url, self.base, name=name, **settings)
        self.procs[name] = proc
        proc.start()
        return proc

    @property
    def edge_url(self) -> str:
        """gRPC address of the edge (a stack started with ``edge=True``)."""
        return f"127.0.0.1:{self.procs['edge'].ports['grpc']}"

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
        if self.with_edge:
            self._spawn("edge", EDGE, {})
            self.procs["edge"].wait_ready()
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


def make_models(out: Path) -> tuple[Path, Path]:
    """Write the fraud model (the repository's own script) and the slow model."""
    fraud = out / "fraud"
    make_fraud_model(fraud)
    slow = out / SLOW_MODEL
    slow.mkdir(parents=True)
    onnx.save_model(build_slow_model(), str(slow / "model.onnx"))
    config = json.loads((fraud / "config.json").read_text())
    config.update(name=SLOW_MODEL, max_batch_size=1, batching={"max_queue_delay_us": 0})
    (slow / "config.json").write_text(json.dumps(config, indent=2))
    return fraud, slow


# --- the load ---------------------------------------------------------------------


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
    stack_class: type[_Stack], base: Path, *, with_slow: bool = False, edge: bool = False
) -> Iterator[_Stack]:
    """A started `stack_class` under `base` with a (high) cluster limit in Redis and
    the fraud model ready (and `SLOW_MODEL` with `with_slow`, the gRPC edge in front
    of the gateways with `edge`); stopped on exit."""
    fraud, slow = make_models(base / "models")
    stack = (
        stack_class(base / "stack", env=environment(), edge=True)
        if edge
        else stack_class(base / "stack", env=environment())
    )
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
