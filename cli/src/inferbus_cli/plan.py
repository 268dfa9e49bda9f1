"""What `inferbus up` starts: the options, the order, each process's command and env.

Pure functions: building a plan starts nothing. Services are configured only by
environment variables (``INFERBUS_<SERVICE>_...``, see each service's
``settings.py``); the addresses of NATS, Redis and the registry are only known
once those run (they may bind port 0), so each spec is built just before its
process starts, from the endpoints learnt so far.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from inferbus_cli.probes import PortClaim

#: service name → (python module, env prefix).
SERVICE_MODULES: dict[str, tuple[str, str]] = {
    "registry": ("inferbus_registry", "INFERBUS_REGISTRY_"),
    "router": ("inferbus_router", "INFERBUS_ROUTER_"),
    "batcher": ("inferbus_batcher", "INFERBUS_BATCHER_"),
    "worker": ("inferbus_worker", "INFERBUS_WORKER_"),
    "gateway": ("inferbus_gateway", "INFERBUS_GATEWAY_"),
    # Run with the vLLM environment's interpreter (`UpOptions.llm_python`).
    "llm-worker": ("inferbus_worker.llm", "INFERBUS_LLM_"),
}


@dataclass(slots=True)
class Ports:
    """Ports of the stack; 0 lets the process pick a free one.

    Defaults follow docs/architecture.md. Workers use ``worker_metrics + i``.
    """

    nats: int = 4222
    nats_monitor: int = 8222
    nats_cluster: int = 6222
    redis: int = 6379
    gateway_http: int = 8000
    gateway_grpc: int = 8001
    gateway_metrics: int = 8002
    edge_grpc: int = 8003
    edge_metrics: int = 8004
    router_metrics: int = 8012
    batcher_metrics: int = 8022
    worker_metrics: int = 8032
    registry_grpc: int = 8070
    registry_metrics: int = 8042
    llm_worker_metrics: int = 8052

    def worker_metrics_port(self, index: int) -> int:
        """Metrics port of worker `index` (0-based); 0 stays 0."""
        return self.worker_metrics + index if self.worker_metrics else 0

    def nats_node(self, index: int) -> tuple[int, int, int]:
        """(client, monitoring, cluster) ports of NATS node `index` (0-based): each
        base port plus the index; 0 stays 0."""

        def shifted(port: int) -> int:
            return port + index if port else 0

        return shifted(self.nats), shifted(self.nats_monitor), shifted(self.nats_cluster)


@dataclass(slots=True)
class S3Options:
    """Object store settings handed to the registry when ``--store s3``."""

    endpoint: str = "127.0.0.1:9000"
    access_key: str = ""
    secret_key: str = ""
    bucket: str = "inferbus"
    secure: bool = False


@dataclass(slots=True)
class UpOptions:
    """Everything `inferbus up` was asked for.

    Attributes:
        home: state directory (logs, run files, NATS and model stores).
        detached: return once everything is up instead of supervising.
        store: where the registry keeps artifacts.
        s3: S3 settings when `store` is ``s3``.
        workers: number of worker processes.
        gateways: gateway processes sharing the HTTP and gRPC ports: ``gateway``
            (the first), then ``gateway-2`` ... ``gateway-N``.
        ports: listening ports.
        redis: start redis-server (when it is installed).
        pool: worker pool of the workers.
        timeout_s: how long each process may take to become ready.
        log_level: log level of the services.
        llm_python: interpreter of the vLLM environment; when set, an LLM worker
            starts too and the tiny generative model is pushed (see `inferbus_cli.llm`).
        worker_python: interpreter of the tensor workers (None: the CLI's); the
            PyTorch environment's when it exists (see `inferbus_cli.torchenv`).
        nats_cluster: NATS nodes: 1 (one nats-server) or a cluster of 3 or 5
            with clustered JetStream, whose streams and buckets then keep 3 replicas.
        gpus: UUIDs of the GPUs ``--gpus`` named: worker i sees only ``gpus[i]``
            (empty: the workers inherit the CLI's ``CUDA_VISIBLE_DEVICES``).
        stack_id: this stack's id, given to the registry and the gateways (they
            refuse a CLI call that expects another stack) and kept in the state file.
        edge: start ``inferbus-edge`` (services/edge) once the gateways are up: a
            compiled gRPC front on ``ports.edge_grpc`` that carries unary calls to
            the gateways over NATS (docs/architecture.md, "The gRPC edge").
    """

    home: Path
    detached: bool = False
    store: Literal["local", "s3"] = "local"
    s3: S3Options = field(default_factory=S3Options)
    workers: int = 1
    gateways: int = 1
    ports: Ports = field(default_factory=Ports)
    redis: bool = True
    pool: str = "default"
    timeout_s: float = 60.0
    log_level: str = "INFO"
    llm_python: Path | None = None
    worker_python: Path | None = None
    nats_cluster: int = 1
    gpus: tuple[str, ...] = ()
    stack_id: str = ""
    edge: bool = False

    @property
    def nats_names(self) -> list[str]:
        """``["nats"]``, or ``nats-1`` ... ``nats-N`` for a cluster."""
        if self.nats_cluster == 1:
            return ["nats"]
        return [f"nats-{i + 1}" for i in range(self.nats_cluster)]

    @property
    def jetstream_replicas(self) -> int:
        """Replicas of the streams and buckets the services create: 3 on a cluster."""
        return 1 if self.nats_cluster == 1 else 3

    @property
    def logs_dir(self) -> Path:
        """Where every process's log file goes."""
        return self.home / "logs"

    @property
    def run_dir(self) -> Path:
        """Where ports files (and the Redis socket) go."""
        return self.home / "run"


@dataclass(slots=True)
class ProcessSpec:
    """How to start one process of the stack.

    Attributes:
        name: name in `state.json` and in messages.
        kind: ``nats``, ``redis`` or ``service`` (decides how readiness is probed).
        argv: command line.
        env: variables added to the CLI's environment.
        log: file receiving stdout and stderr.
        ports_file: where the service writes its bound ports (services only).
        redis_address: ``127.0.0.1:PORT`` or a unix socket path (redis only).
        health_path: NATS monitoring path that says it is up (nats only): a
            cluster node is up once it is current with the cluster (``/healthz``).
    """

    name: str
    kind: Literal["nats", "redis", "service"]
    argv: list[str]
    env: dict[str, str]
    log: Path
    ports_file: Path | None = None
    redis_address: str = ""
    health_path: str = "/healthz?js-enabled-only=true"


def process_names(options: UpOptions, *, with_redis: bool) -> list[str]:
    """Start order: infrastructure, registry, data path back to front, gateway last."""
    return [name for stage in process_stages(options, with_redis=with_redis) for name in stage]


def process_stages(options: UpOptions, *, with_redis: bool) -> list[list[str]]:
    """Groups started together; a group starts once the one before it is up.

    Within a group nothing depends on another member: the registry, router
    and batcher need only NATS; the workers need the registry's address and
    the gateway needs NATS (and Redis). Starting a group at once roughly
    halves the start-up time, which is mostly Python imports.
    """
    stages = [options.nats_names]
    if with_redis:
        stages.append(["redis"])
    stages.append(["registry", "router", "batcher"])
    stages.append([*(f"worker-{i + 1}" for i in range(options.workers)), "gateway"])
    if options.llm_python is not None:
        stages[-1].insert(len(stages[-1]) - 1, "llm-worker")  # the gateway stays last
    if options.gateways > 1:
        # The others join the first one's ports once it is up (and has them).
        stages.append([f"gateway-{i + 1}" for i in range(1, options.gateways)])
    if options.edge:
        stages.append(["edge"])
    return stages


def port_claims(options: UpOptions, *, with_redis: bool) -> list[PortClaim]:
    """Every fixed port the stack will bind, with the flag that changes it."""
    p = options.ports
    claims = []
    for i, name in enumerate(options.nats_names):
        client, monitor, cluster = p.nats_node(i)
        label = "NATS" if options.nats_cluster == 1 else f"NATS node {name}"
        claims += [
            PortClaim(client, label, "--nats-port"),
            PortClaim(monitor, f"{label} monitoring", "--nats-monitor-port"),
        ]
        if options.nats_cluster > 1:
            claims.append(PortClaim(cluster, f"{label} routes", "--nats-cluster-port"))
    claims += [
        PortClaim(p.registry_grpc, "registry gRPC", "--registry-port"),
        PortClaim(p.registry_metrics, "registry metrics", "--registry-metrics-port"),
        PortClaim(p.router_metrics, "router metrics", "--router-metrics-port"),
        PortClaim(p.batcher_metrics, "batcher metrics", "--batcher-metrics-port"),
        PortClaim(p.gateway_http, "gateway HTTP", "--http-port"),
        PortClaim(p.gateway_grpc, "gateway gRPC", "--grpc-port"),
        PortClaim(p.gateway_metrics, "gateway metrics", "--metrics-port"),
    ]
    claims += [
        PortClaim(p.worker_metrics_port(i), f"worker-{i + 1} metrics", "--worker-metrics-port")
        for i in range(options.workers)
    ]
    if with_redis:
        claims.append(PortClaim(p.redis, "Redis", "--redis-port"))
    if options.edge:
        claims += [
            PortClaim(p.edge_grpc, "edge gRPC", "--edge-port"),
            PortClaim(p.edge_metrics, "edge metrics", "--edge-metrics-port"),
        ]
    if options.llm_python is not None:
        claims.append(PortClaim(p.llm_worker_metrics, "LLM worker metrics", "--no-llm"))
    return claims


def find_nats_server() -> str | None:
    """The nats-server binary: next to this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    return shutil.which("nats-server")


def find_edge() -> str | None:
    """The inferbus-edge binary: next to this Python (where scripts/build-edge.sh
    puts it), else on PATH."""
    beside = Path(sys.executable).parent / "inferbus-edge"
    if beside.is_file():
        return str(beside)
    return shutil.which("inferbus-edge")


def edge_spec(options: UpOptions, binary: str, endpoints: dict[str, str]) -> ProcessSpec:
    """inferbus-edge: gRPC on ``ports.edge_grpc``, unary calls to the gateways over
    NATS, streams and oversized requests proxied to the first gateway's gRPC port.
    Configured like the Python services, by ``INFERBUS_EDGE_*`` variables."""
    p = options.ports
    ports_file = options.run_dir / "edge.json"
    values: dict[str, str | int] = {
        "NATS_URL": endpoints["nats"],
        "HOST": "127.0.0.1",
        "GRPC_PORT": p.edge_grpc,
        "METRICS_PORT": p.edge_metrics,
        "UPSTREAM": endpoints["gateway_grpc"],
        "PORTS_FILE": str(ports_file),
    }
    env = {"INFERBUS_EDGE_" + key: str(value) for key, value in values.items()}
    return ProcessSpec("edge", "service", [binary], env, options.logs_dir / "edge.log", ports_file)


def find_redis_server() -> str | None:
    """The redis-server binary on PATH, if installed."""
    return shutil.which("redis-server")


def nats_spec(options: UpOptions, binary: str) -> ProcessSpec:
    """nats-server with JetStream, its store under the home, ports reported to run/."""
    p = options.ports
    # -1 asks nats-server for a random port; it then reports it in its ports file.
    argv = [
        binary,
        "-a",
        "127.0.0.1",
        "-p",
        str(p.nats or -1),
        "-m",
        str(p.nats_monitor or -1),
        "-js",
        "-sd",
        str(options.home / "nats"),
        "--ports_file_dir",
        str(options.run_dir),
    ]
    return ProcessSpec("nats", "nats", argv, {}, options.logs_dir / "nats.log")


def nats_node_spec(
    options: UpOptions, binary: str, index: int, cluster_ports: list[int]
) -> ProcessSpec:
    """Node `index` (0-based) of a NATS cluster with clustered JetStream.

    Every node routes to every node (nats-server needs configured routes for
    clustered JetStream, and ignores its own), so the cluster ports are fixed
    before any node starts: `cluster_ports` holds one per node.
    """
    name = options.nats_names[index]
    client, monitor, _cluster = options.ports.nats_node(index)
    routes = ",".join(f"nats://127.0.0.1:{port}" for port in cluster_ports)
    argv = [
        binary,
        "-a",
        "127.0.0.1",
        "-p",
        str(client or -1),
        "-m",
        str(monitor or -1),
        "-js",
        "-sd",
        str(options.home / "nats" / name),
        "--server_name",
        name,
        "--cluster_name",
        "inferbus",
        "--cluster",
        f"nats://127.0.0.1:{cluster_ports[index]}",
        "--routes",
        routes,
        "--ports_file_dir",
        str(options.run_dir),
    ]
    return ProcessSpec(
        name, "nats", argv, {}, options.logs_dir / f"{name}.log", health_path="/healthz"
    )


def redis_spec(options: UpOptions, binary: str) -> ProcessSpec:
    """redis-server without persistence; port 0 → a unix socket under run/.

    Redis treats ``--port 0`` as "no TCP at all", so a free-port request is
    served on a unix socket instead, whose path is known in advance.
    """
    data_dir = options.home / "redis"
    argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(data_dir)]
    if options.ports.redis:
        argv += ["--port", str(options.ports.redis)]
        address = f"127.0.0.1:{options.ports.redis}"
    else:
        address = str(options.run_dir / "redis.sock")
        argv += ["--port", "0", "--unixsocket", address, "--unixsocketperm", "700"]
    return ProcessSpec(
        "redis", "redis", argv, {}, options.logs_dir / "redis.log", redis_address=address
    )


def redis_url(address: str) -> str:
    """redis-py URL for a ``HOST:PORT`` or unix socket address."""
    return f"unix://{address}" if address.startswith("/") else f"redis://{address}/0"


def service_spec(options: UpOptions, name: str, endpoints: dict[str, str]) -> ProcessSpec:
    """The spec of one inferbus service, from the endpoints known so far.

    Args:
        options: what `up` was asked for.
        name: ``registry``, ``router``, ``batcher``, ``worker-N`` or ``gateway``.
        endpoints: at least ``nats`` (every node's URL, comma-separated, on a
            cluster); ``registry`` for workers; ``redis`` when running.
    """
    kind = name.split("-")[0] if name.startswith(("worker-", "gateway-")) else name
    module, prefix = SERVICE_MODULES[kind]
    p = options.ports
    ports_file = options.run_dir / f"{name}.json"
    values: dict[str, str | int] = {
        "NATS_URL": endpoints["nats"],
        "JETSTREAM_REPLICAS": options.jetstream_replicas,
        "HOST": "127.0.0.1",
        "PORTS_FILE": str(ports_file),
        "LOG_LEVEL": options.log_level,
    }
    if kind == "registry":
        values |= {"GRPC_PORT": p.registry_grpc, "METRICS_PORT": p.registry_metrics}
        values["STORE"] = options.store
        if options.store == "local":
            values["STORE_DIR"] = str(options.home / "models")
        else:
            values |= {
                "S3_ENDPOINT": options.s3.endpoint,
                "S3_ACCESS_KEY": options.s3.access_key,
                "S3_SECRET_KEY": options.s3.secret_key,
                "S3_BUCKET": options.s3.bucket,
                "S3_SECURE": str(options.s3.secure).lower(),
            }
    elif kind == "router":
        values["METRICS_PORT"] = p.router_metrics
    elif kind == "batcher":
        values["METRICS_PORT"] = p.batcher_metrics
    elif kind == "worker":
        index = int(name.removeprefix("worker-")) - 1
        values |= {
            "METRICS_PORT": p.worker_metrics_port(index),
            "REGISTRY_URL": endpoints["registry"],
            # One cache per worker: two processes never write the same file.
            "CACHE_DIR": str(options.home / "cache" / name),
            "POOL": options.pool,
        }
    elif kind == "gateway":
        values |= _gateway_ports(options, name, endpoints)
        values |= {
            "REDIS_URL": redis_url(endpoints["redis"]) if endpoints.get("redis") else "",
            # Triton's repository extension (/v2/repository/...) calls the registry.
            "REGISTRY_URL": endpoints.get("registry", ""),
        }
    elif kind == "llm-worker":
        values |= {
            "METRICS_PORT": p.llm_worker_metrics,
            "REGISTRY_URL": endpoints["registry"],
            "CACHE_DIR": str(options.home / "cache" / name),
            "POOL": "llm",
        }
    if kind in ("registry", "gateway") and options.stack_id:
        values["STACK_ID"] = options.stack_id
    env = {prefix + key: str(value) for key, value in values.items()}
    if kind == "worker" and options.gpus:
        # One GPU per worker, by UUID (stable whatever the CUDA device order);
        # PCI order makes CUDA's ordinals match NVML's and nvidia-smi's.
        index = int(name.removeprefix("worker-")) - 1
        env |= {
            "CUDA_VISIBLE_DEVICES": options.gpus[index % len(options.gpus)],
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    python = {"llm-worker": options.llm_python, "worker": options.worker_python}.get(kind)
    argv = [str(python or sys.executable), "-m", module]
    return ProcessSpec(name, "service", argv, env, options.logs_dir / f"{name}.log", ports_file)


def _gateway_ports(
    options: UpOptions, name: str, endpoints: dict[str, str]
) -> dict[str, str | int]:
    """Ports (and port group) of gateway process `name`.

    With one gateway it binds its ports alone. In a group the first one
    (``gateway``) checks that the shared ports are free, then binds them with
    SO_REUSEPORT; ``gateway-2`` ... join the ports it got (so ``--free-ports``
    works too) and take a metrics port of their own (any free one).
    """
    p = options.ports
    if options.gateways == 1:
        return {
            "HTTP_PORT": p.gateway_http,
            "GRPC_PORT": p.gateway_grpc,
            "METRICS_PORT": p.gateway_metrics,
        }
    if name == "gateway":
        return {
            "HTTP_PORT": p.gateway_http,
            "GRPC_PORT": p.gateway_grpc,
            "METRICS_PORT": p.gateway_metrics,
            "PORT_GROUP": "first",
        }
    return {
        "HTTP_PORT": endpoints["gateway_http"].rsplit(":", 1)[1],
        "GRPC_PORT": endpoints["gateway_grpc"].rsplit(":", 1)[1],
        "METRICS_PORT": 0,
        "PORT_GROUP": "join",
    }


#: Port settings of a service, by the role it reports them under in its ports file.
_PORT_SETTINGS = {"grpc": "GRPC_PORT", "http": "HTTP_PORT", "metrics": "METRICS_PORT"}


def pinned_spec(spec: ProcessSpec, ports: dict[str, object]) -> ProcessSpec:
    """`spec` again, on the ports the process had (to restart it where clients find it).

    Args:
        spec: how the process was started (possibly on port 0).
        ports: what it reported once up (`ProcessRecord.ports`).
    """
    argv, env = list(spec.argv), dict(spec.env)
    if spec.kind == "nats":
        for flag, role in (("-p", "client"), ("-m", "monitoring")):
            if role in ports and flag in argv:
                argv[argv.index(flag) + 1] = str(ports[role])
    elif spec.kind == "service":
        prefix = next((k.removesuffix("NATS_URL") for k in env if k.endswith("_NATS_URL")), "")
        for role, setting in _PORT_SETTINGS.items():
            if role in ports and prefix:
                env[prefix + setting] = str(ports[role])
        if env.get(prefix + "PORT_GROUP") == "first":
            # A restarted first gateway joins the ports the rest of its group still holds.
            env[prefix + "PORT_GROUP"] = "join"
    return ProcessSpec(
        spec.name,
        spec.kind,
        argv,
        env,
        spec.log,
        spec.ports_file,
        spec.redis_address,
        spec.health_path,
    )
