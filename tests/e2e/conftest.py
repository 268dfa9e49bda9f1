"""The whole stack as real processes: nats-server, registry, router, batcher,
two workers and a gateway, with the example fraud model pushed and ready.

Module-scoped: starting it costs a few seconds, so each test module that uses
it shares one stack.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.servers import NatsServer, RedisServer

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stack:
    """Handles to a running stack."""

    nats: NatsServer
    registry: ServiceProcess
    router: ServiceProcess
    batcher: ServiceProcess
    workers: list[ServiceProcess]
    gateway: ServiceProcess
    model_dir: Path
    base: Path
    env: dict[str, str] = field(default_factory=dict)
    module_env: dict[str, str] = field(default_factory=dict)
    redis: RedisServer | None = None

    def metrics(self, proc: ServiceProcess) -> dict[str, float]:
        """Scrape a service's /metrics into {"name{label=value,...}": value}."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{proc.ports['metrics']}/metrics").text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    @property
    def grpc_url(self) -> str:
        """Gateway KServe V2 gRPC address."""
        return f"127.0.0.1:{self.gateway.ports['grpc']}"

    @property
    def http_url(self) -> str:
        """Gateway KServe V2 REST address (host:port, as tritonclient wants it)."""
        return f"127.0.0.1:{self.gateway.ports['http']}"

    @property
    def registry_url(self) -> str:
        """Registry gRPC address."""
        return f"127.0.0.1:{self.registry.ports['grpc']}"

    def start_worker(self, name: str) -> ServiceProcess:
        """Start one more worker process."""
        worker = ServiceProcess(
            "inferbus_worker",
            name=name,
            env={
                **self.env,
                "INFERBUS_WORKER_NATS_URL": self.nats.url,
                "INFERBUS_WORKER_REGISTRY_URL": self.registry_url,
                "INFERBUS_WORKER_CACHE_DIR": str(self.base / f"cache-{name}"),
                "INFERBUS_WORKER_METRICS_PORT": "0",
                **self.module_env,
            },
            log_dir=self.base,
        )
        worker.start()
        return worker


def make_fraud_model(out: Path) -> Path:
    """Write the example model with the repository's own script."""
    subprocess.run(
        [sys.executable, str(REPO / "examples/fraud/make_model.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


async def _push(registry_url: str, model_dir: Path) -> None:
    from inferbus_registry.client import RegistryClient

    async with RegistryClient(registry_url) as client:
        await client.push(model_dir, "fraud", "1", aliases=["stable"])


def wait_model_ready(grpc_url: str, model: str, timeout: float = 60.0) -> None:
    """Poll KServe ModelReady through the gateway."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if client.is_model_ready(model):
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"model {model} not ready after {timeout}s")


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A full stack serving the fraud model (two workers).

    A test module may set ``STACK_ENV`` (a dict of environment variables) to
    configure every service of its stack, e.g. a short worker ack wait, and
    ``STACK_REDIS = True`` to give the gateway a real redis-server.
    """
    base = tmp_path_factory.mktemp("stack")
    module_env: dict[str, str] = getattr(request.module, "STACK_ENV", {})
    model_dir = make_fraud_model(base / "fraud-model")
    env = {"INFERBUS_LOG_LEVEL": "INFO"}
    procs: list[ServiceProcess] = []
    nats = NatsServer(base / "nats")
    nats.start()
    redis = RedisServer(base / "redis") if getattr(request.module, "STACK_REDIS", False) else None
    try:
        if redis is not None:
            redis.start()
            module_env = {**module_env, "INFERBUS_GATEWAY_REDIS_URL": redis.url}

        def start(module: str, extra: dict[str, str], name: str | None = None) -> ServiceProcess:
            prefix = module.upper() + "_"
            proc = ServiceProcess(
                module,
                name=name,
                env={
                    f"{prefix}NATS_URL": nats.url,
                    f"{prefix}METRICS_PORT": "0",
                    **module_env,
                    **extra,
                },
                log_dir=base,
            )
            procs.append(proc)
            proc.start()
            return proc

        registry = start(
            "inferbus_registry",
            {
                "INFERBUS_REGISTRY_GRPC_PORT": "0",
                "INFERBUS_REGISTRY_STORE_DIR": str(base / "store"),
            },
        )
        registry_url = f"127.0.0.1:{registry.ports['grpc']}"
        router = start("inferbus_router", {})
        batcher = start("inferbus_batcher", {})
        workers = [
            start(
                "inferbus_worker",
                {
                    "INFERBUS_WORKER_REGISTRY_URL": registry_url,
                    "INFERBUS_WORKER_CACHE_DIR": str(base / f"cache-w{i}"),
                },
                name=f"worker{i}",
            )
            for i in range(2)
        ]
        gateway = start(
            "inferbus_gateway",
            {"INFERBUS_GATEWAY_HTTP_PORT": "0", "INFERBUS_GATEWAY_GRPC_PORT": "0"},
        )
        for proc in procs:
            proc.wait_ready()
        asyncio.run(_push(registry_url, model_dir))
        st = Stack(
            nats,
            registry,
            router,
            batcher,
            workers,
            gateway,
            model_dir,
            base,
            env,
            module_env,
            redis,
        )
        wait_model_ready(st.grpc_url, "fraud")
        yield st
    finally:
        for proc in reversed(procs):
            proc.terminate(timeout=10)
            proc.cleanup()
        nats.close()
        if redis is not None:
            redis.close()
