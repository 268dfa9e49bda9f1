"""Start the inferbus stack as real processes for benchmarks.

The same processes as ``tests/e2e/conftest.py`` (nats-server with JetStream,
registry, router, batcher, workers, gateway, each ``python -m <service>``),
with logs and stores in a temp folder. Models are pushed through the
registry's gRPC API, exactly as users do.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.servers import NatsServer


@dataclass
class BenchStack:
    """A running inferbus stack.

    Args:
        base: folder for logs, the object store and worker caches.
        workers: number of worker processes.
    """

    base: Path
    workers: int = 2
    nats: NatsServer | None = None
    procs: dict[str, ServiceProcess] = field(default_factory=dict)

    @property
    def grpc_url(self) -> str:
        """Gateway KServe V2 gRPC address."""
        return f"127.0.0.1:{self.procs['gateway'].ports['grpc']}"

    @property
    def http_url(self) -> str:
        """Gateway KServe V2 REST address."""
        return f"127.0.0.1:{self.procs['gateway'].ports['http']}"

    @property
    def registry_url(self) -> str:
        """Registry gRPC address."""
        return f"127.0.0.1:{self.procs['registry'].ports['grpc']}"

    def pids(self) -> dict[str, int]:
        """Process id of every service, by name."""
        return {name: p.pid for name, p in self.procs.items() if p.pid is not None}

    def _start(self, name: str, module: str, extra: dict[str, str]) -> ServiceProcess:
        assert self.nats is not None
        prefix = module.upper() + "_"
        proc = ServiceProcess(
            module,
            name=name,
            env={
                f"{prefix}NATS_URL": self.nats.url,
                f"{prefix}METRICS_PORT": "0",
                "INFERBUS_LOG_LEVEL": "WARNING",
                **extra,
            },
            log_dir=self.base,
        )
        self.procs[name] = proc
        proc.start()
        return proc

    def start(self) -> Self:
        """Start nats-server and every service; return once all are ready."""
        self.base.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(self.base / "nats")
        self.nats.start()
        self._start(
            "registry",
            "inferbus_registry",
            {
                "INFERBUS_REGISTRY_GRPC_PORT": "0",
                "INFERBUS_REGISTRY_STORE_DIR": str(self.base / "store"),
            },
        )
        self._start("router", "inferbus_router", {})
        self._start("batcher", "inferbus_batcher", {})
        for i in range(self.workers):
            self._start(
                f"worker{i}",
                "inferbus_worker",
                {
                    "INFERBUS_WORKER_REGISTRY_URL": self.registry_url,
                    "INFERBUS_WORKER_CACHE_DIR": str(self.base / f"cache-w{i}"),
                },
            )
        self._start(
            "gateway",
            "inferbus_gateway",
            {"INFERBUS_GATEWAY_HTTP_PORT": "0", "INFERBUS_GATEWAY_GRPC_PORT": "0"},
        )
        for proc in self.procs.values():
            proc.wait_ready()
        return self

    def close(self) -> None:
        """Stop every service (reverse start order), then nats-server."""
        for proc in reversed(list(self.procs.values())):
            proc.terminate(timeout=10)
            proc.cleanup()
        self.procs.clear()
        if self.nats is not None:
            self.nats.close()
            self.nats = None

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

    def push(self, model_dir: Path, name: str, version: str = "1") -> None:
        """Push a model version through the registry and make it ``stable``."""
        from inferbus_registry.client import RegistryClient

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

    def histogram_totals(self, service_prefix: str, metric: str) -> tuple[float, float]:
        """Sum and count of a Prometheus histogram over every process of a service.

        The difference of two readings gives the mean of what was observed in
        between: rows per micro-batch (batcher ``inferbus_batcher_batch_rows``)
        or rows per engine execution (worker ``inferbus_worker_batch_size``).

        Args:
            service_prefix: process name prefix (``"batcher"``, ``"worker"``).
            metric: histogram name without the ``_sum``/``_count`` suffix.
        """
        pattern = re.compile(rf"{re.escape(metric)}_(sum|count)(\{{[^}}]*\}})? ([0-9.eE+-]+)")
        total = count = 0.0
        for name, proc in self.procs.items():
            if not name.startswith(service_prefix):
                continue
            port = proc.ports["metrics"]
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
            for line in text.splitlines():
                m = pattern.match(line)
                if m:
                    if m.group(1) == "sum":
                        total += float(m.group(3))
                    else:
                        count += float(m.group(3))
        return total, count

    def batch_rows(self) -> tuple[float, float]:
        """Sum and count of rows per micro-batch cut by the batcher."""
        return self.histogram_totals("batcher", "inferbus_batcher_batch_rows")

    def engine_rows(self) -> tuple[float, float]:
        """Sum and count of rows per engine execution over all workers.

        Larger than `batch_rows` when workers merge waiting micro-batches.
        """
        return self.histogram_totals("worker", "inferbus_worker_batch_size")
