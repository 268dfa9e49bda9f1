"""The whole inferbus stack as real processes, for end-to-end tests and benchmarks.

nats-server (JetStream), optionally redis-server, then the registry (local
store), router, batcher, N workers and the gateway, each ``python -m
<service>`` on ports it picks and reports, with logs, stores and worker
caches under one folder::

    with LocalStack(tmp_path, workers=2) as stack:
        stack.push(model_dir, "fraud")
        stack.wait_model_ready("fraud")
        ...  # stack.grpc_url, stack.http_url, stack.registry_url

`env` is given to every service (each reads only its own prefix).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.servers import NatsServer, RedisServer


class LocalStack:
    """A running stack of real processes.

    Args:
        base: folder for logs, the object store and worker caches.
        workers: number of worker processes.
        env: extra environment for every service.
        with_redis: also start redis-server and point the gateway at it.
    """

    def __init__(
        self,
        base: Path,
        *,
        workers: int = 2,
        env: dict[str, str] | None = None,
        with_redis: bool = False,
    ) -> None:
        self.base = base
        self.worker_count = workers
        self.env = dict(env or {})
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = RedisServer(base / "redis") if with_redis else None
        self.procs: dict[str, ServiceProcess] = {}
        self.interpreters: dict[str, str] = {}
        """Service name → the Python that runs it (absent: this one)."""

    # --- handles -------------------------------------------------------------
    @property
    def registry(self) -> ServiceProcess:
        """The registry process."""
        return self.procs["registry"]

    @property
    def router(self) -> ServiceProcess:
        """The router process."""
        return self.procs["router"]

    @property
    def batcher(self) -> ServiceProcess:
        """The batcher process."""
        return self.procs["batcher"]

    @property
    def gateway(self) -> ServiceProcess:
        """The gateway process."""
        return self.procs["gateway"]

    @property
    def workers(self) -> list[ServiceProcess]:
        """The worker processes started with the stack, in order."""
        return [self.procs[f"worker{i}"] for i in range(self.worker_count)]

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

    @property
    def nats_url(self) -> str:
        """What every service is given as its NATS URL."""
        assert self.nats is not None
        return self.nats.url

    def pids(self) -> dict[str, int]:
        """Process id of every service, by name."""
        return {name: p.pid for name, p in self.procs.items() if p.pid is not None}

    # --- lifecycle -----------------------------------------------------------
    def _spawn(self, name: str, module: str, extra: dict[str, str]) -> ServiceProcess:
        prefix = module.upper() + "_"
        proc = ServiceProcess(
            module,
            name=name,
            python=self.interpreters.get(name),
            env={
                f"{prefix}NATS_URL": self.nats_url,
                f"{prefix}METRICS_PORT": "0",
                **self.env,
                **extra,
            },
            log_dir=self.base,
        )
        self.procs[name] = proc
        proc.start()
        return proc

    def _nats_args(self) -> list[str]:
        """Extra nats-server arguments (a subclass adds its configuration file)."""
        return []

    def _worker_env(self, name: str) -> dict[str, str]:
        return {
            "INFERBUS_WORKER_REGISTRY_URL": self.registry_url,
            "INFERBUS_WORKER_CACHE_DIR": str(self.base / f"cache-{name}"),
        }

    def start(self) -> Self:
        """Start every server and service; return once all are ready."""
        self.base.mkdir(parents=True, exist_ok=True)
        self._start_nats()
        if self.redis is not None:
            self.redis.start()
            self.env["INFERBUS_GATEWAY_REDIS_URL"] = self.redis.url
        self._spawn(
            "registry",
            "inferbus_registry",
            {
                "INFERBUS_REGISTRY_GRPC_PORT": "0",
                "INFERBUS_REGISTRY_STORE_DIR": str(self.base / "store"),
            },
        )
        self._spawn("router", "inferbus_router", {})
        self._spawn("batcher", "inferbus_batcher", {})
        for i in range(self.worker_count):
            name = f"worker{i}"
            self._spawn(name, "inferbus_worker", self._worker_env(name))
        self._spawn(
            "gateway",
            "inferbus_gateway",
            {
                "INFERBUS_GATEWAY_HTTP_PORT": "0",
                "INFERBUS_GATEWAY_GRPC_PORT": "0",
                # Triton's repository extension calls the registry.
                "INFERBUS_GATEWAY_REGISTRY_URL": self.registry_url,
            },
        )
        for proc in self.procs.values():
            proc.wait_ready()
        return self

    def _start_nats(self) -> None:
        """Start the NATS the services use (a subclass may start a cluster instead)."""
        self.nats = NatsServer(self.base / "nats", extra_args=self._nats_args())
        self.nats.start()

    def _stop_nats(self) -> None:
        if self.nats is not None:
            self.nats.close()
            self.nats = None

    def start_worker(
        self, name: str, python: str | None = None, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start one more worker (its own empty cache) and return it once it runs.

        Args:
            name: the worker's name (its log and cache directory).
            python: the interpreter (None: this one); ``.venvs/torch/bin/python``
                starts a worker that can serve PyTorch versions.
            env: more of its environment (``INFERBUS_WORKER_POOL``...).
        """
        if python is not None:
            self.interpreters[name] = python
        return self._spawn(name, "inferbus_worker", {**self._worker_env(name), **(env or {})})

    def close(self) -> None:
        """Stop every service (reverse start order), then the servers."""
        for proc in reversed(list(self.procs.values())):
            proc.terminate(timeout=10)
            proc.cleanup()
        self.procs.clear()
        self._stop_nats()
        if self.redis is not None:
            self.redis.close()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- models and metrics --------------------------------------------------
    def push(self, model_dir: Path, name: str, version: str = "1") -> None:
        """Push a model version through the registry and make it ``stable``."""
        from inferbus_client.registry import RegistryClient

        async def _push() -> None:
            async with RegistryClient(self.registry_url) as client:
                await client.push(model_dir, name, version, aliases=["stable"])

        asyncio.run(_push())

    def wait_model_ready(self, model: str, timeout: float = 60.0) -> None:
        """Poll KServe ModelReady through the gateway until it says yes."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if client.is_model_ready(model):
                    return
                time.sleep(0.01)
        finally:
            client.close()
        raise TimeoutError(f"model {model} not ready after {timeout}s")

    def metrics(self, proc: ServiceProcess) -> dict[str, float]:
        """Scrape a service's /metrics into ``{"name{label=value,...}": value}``."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{proc.ports['metrics']}/metrics", timeout=5.0).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out
