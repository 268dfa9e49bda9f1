"""pytest plugin with the shared inferbus fixtures (loaded by the root ``conftest.py``).

Fixtures:

* ``nats_server`` — a fresh `NatsServer` (JetStream, file store) per test; about
  15 ms to start. ``nats_server.url``, ``.kill()``, ``.restart()``.
* ``nats_client`` — an async ``nats.aio.client.Client`` connected to
  ``nats_server``, drained after the test.
* ``redis_server`` — a fresh `RedisServer` per test (about 15 ms).
* ``s3_server`` — one `S3Server` (SeaweedFS) for the whole session, because it
  takes about 3 s to start; tests must use their own bucket (``s3_bucket``).
* ``s3_bucket`` — a new, uniquely named, empty bucket on ``s3_server``.
* ``tmp_state`` — an empty per-test directory for state files (ports, models,
  caches), under pytest's ``tmp_path``.
* ``spawn_service`` — ``await spawn_service("inferbus_router", env={...})``
  starts a service as a real process (see `ServiceProcess`) and waits for its
  ports file; every process it started is terminated after the test.

Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, on machines
without an NVIDIA GPU (``nvidia-smi -L`` lists none).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

from inferbus_testing.processes import ServiceProcess
from inferbus_testing.servers import NatsServer, RedisServer, S3Server


@functools.cache
def gpu_available() -> bool:
    """True when ``nvidia-smi -L`` lists at least one GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when this machine has no GPU."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (nvidia-smi lists none here)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream for one test."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
async def nats_client(nats_server: NatsServer) -> AsyncIterator[Any]:
    """An async NATS client connected to ``nats_server``; drained after the test."""
    import nats

    client = await nats.connect(nats_server.url, connect_timeout=2, max_reconnect_attempts=-1)
    try:
        yield client
    finally:
        if not client.is_closed:
            await client.drain()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh redis-server (no persistence) for one test."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One signature-checking S3 server for the session; use unique buckets."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        server.start()
        yield server
    finally:
        # Its data dir is pytest's tmp dir, so close() stops it; kill for speed.
        server.kill()
        server.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """Name of a new, empty bucket on ``s3_server`` that no other test uses."""
    name = f"t-{uuid.uuid4().hex[:20]}"
    s3_server.client().make_bucket(name)
    return name


@pytest.fixture
def tmp_state(tmp_path: Path) -> Path:
    """An empty directory for one test's state files."""
    path = tmp_path / "state"
    path.mkdir()
    return path


class SpawnService(Protocol):
    """Signature of the ``spawn_service`` fixture's value."""

    def __call__(
        self,
        module: str,
        *,
        env: Mapping[str, str] | None = None,
        env_prefix: str | None = None,
        args: Sequence[str] = (),
        name: str | None = None,
        timeout: float = 20.0,
    ) -> Awaitable[ServiceProcess]:
        """Start `module` as a process and return it once its ports file exists."""
        ...


@pytest.fixture
def spawn_service(tmp_path: Path) -> Iterator[SpawnService]:
    """Factory that starts services as real processes; all are stopped after the test."""
    started: list[ServiceProcess] = []

    async def spawn(
        module: str,
        *,
        env: Mapping[str, str] | None = None,
        env_prefix: str | None = None,
        args: Sequence[str] = (),
        name: str | None = None,
        timeout: float = 20.0,
    ) -> ServiceProcess:
        label = name or f"{module}-{len(started)}"
        proc = ServiceProcess(
            module,
            env=env,
            env_prefix=env_prefix,
            args=args,
            log_dir=tmp_path / "services",
            name=label,
        )
        started.append(proc)
        return await proc.astart(timeout)

    try:
        yield spawn
    finally:
        # Reverse order: dependents (started later) stop before what they use.
        errors: list[BaseException] = []
        for proc in reversed(started):
            try:
                proc.terminate(timeout=10)
            except BaseException as exc:
                errors.append(exc)
            finally:
                proc.cleanup()
        if errors:
            raise errors[0]
