"""The stores: ``redis-server`` (`RedisServer`) and a SeaweedFS S3 endpoint (`S3Server`)."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Self

from inferbus_testing.servers.base import (
    _BIND_ATTEMPTS,
    HOST,
    ServerError,
    _random_port,
    _Server,
    _tcp_accepts,
    find_binary,
)

if TYPE_CHECKING:
    from minio import Minio


class RedisServer(_Server):
    """A real ``redis-server`` (no persistence) on a random free port.

    Args:
        base_dir: working dir and log location; a temp dir when None.
        extra_args: more ``--option value`` arguments for redis-server.
    """

    name = "redis"

    def __init__(self, base_dir: Path | None = None, *, extra_args: Sequence[str] = ()) -> None:
        super().__init__(base_dir)
        self.binary = find_binary("redis-server")
        self.extra_args = tuple(extra_args)
        self.port = 0
        """TCP port (0 until started; kept across restarts)."""

    @property
    def url(self) -> str:
        """Client URL, ``redis://127.0.0.1:PORT/0``."""
        if not self.port:
            raise ServerError("redis: not started yet")
        return f"redis://{HOST}:{self.port}/0"

    def _launch(self, port: int, timeout: float) -> bool:
        """Start on `port`; True when serving, False when the port was taken."""
        self.log_path.unlink(missing_ok=True)
        argv = [
            self.binary,
            "--bind", HOST,
            "--port", str(port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--protected-mode", "no",
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip
        child = self._spawn(argv)
        # Redis logs this only after its own listener is bound, so a foreign
        # server already on the port can never make us think we are up.
        if self._wait_for(child, self._logged_ready, timeout, "'Ready to accept connections'"):
            if not self._ping(port):
                child.kill()
                raise self._fail(f"logged ready but does not answer PING on port {port}")
            return True
        log = self.log_tail(10)
        if "Address already in use" in log or "Could not create server TCP" in log:
            return False
        raise self._fail(f"exited with code {child.proc.returncode} during start-up")

    def _logged_ready(self) -> bool:
        try:
            return "Ready to accept connections" in self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False

    @staticmethod
    def _ping(port: int) -> bool:
        try:
            with socket.create_connection((HOST, port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                # A server with a password answers, but refuses: still serving.
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def start(self, timeout: float = 10.0) -> Self:
        """Start redis-server, retrying other random ports while the chosen one is taken.

        When it ran before, it starts on the same port again (no retry then).

        Raises:
            ServerError: when it cannot start or bind.
        """
        if self.running:
            raise ServerError("redis: already running")
        started = time.monotonic()
        if self.port:
            if not self._launch(self.port, timeout):
                raise self._fail(f"port {self.port} is taken; cannot restart on it")
        else:
            for _ in range(_BIND_ATTEMPTS):
                port = _random_port()
                if self._launch(port, timeout):
                    self.port = port
                    break
            else:
                raise self._fail(f"no free port after {_BIND_ATTEMPTS} attempts")
        self.start_seconds = time.monotonic() - started
        return self

    def restart(self, timeout: float = 10.0) -> Self:
        """Stop (if running) and start again on the same port (data is not persisted)."""
        self.stop()
        return self.start(timeout)

    async def arestart(self, timeout: float = 10.0) -> Self:
        """`restart` in a worker thread."""
        return await asyncio.to_thread(self.restart, timeout)


# weed server listens on 8 ports: master, volume, filer and s3, each http + grpc.
_WEED_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)

# master.toml read by weed from its working dir: grow one volume at a time
# instead of seven, which makes the first write to a new bucket much faster.
_WEED_MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 2
copy_3 = 3
copy_other = 1
"""


class S3Server(_Server):
    """A real S3 endpoint (SeaweedFS ``weed server -s3``) that checks request signatures.

    The server gets one identity with a freshly generated access key and secret
    key, so anonymous or wrongly signed requests are rejected.

    Args:
        base_dir: data dir, config and log location; a temp dir when None.
    """

    name = "s3"

    def __init__(self, base_dir: Path | None = None) -> None:
        super().__init__(base_dir)
        self.binary = find_binary("weed")
        self.access_key = "IB" + secrets.token_hex(9).upper()
        """Access key id of the only identity."""
        self.secret_key = secrets.token_urlsafe(30)
        """Its secret key."""
        self.port = 0
        """S3 HTTP port."""
        self._base_port = 0

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``, as `minio.Minio` and boto want it (plain HTTP)."""
        if not self.port:
            raise ServerError("s3: not started yet")
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.endpoint}"

    def client(self, *, secret_key: str | None = None) -> Minio:
        """A `minio.Minio` client for this server (optionally with another secret)."""
        from minio import Minio  # imported here: only S3 users pay for it

        return Minio(
            self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key if secret_key is None else secret_key,
            secure=False,
        )

    def _write_config(self) -> Path:
        identities = {
            "identities": [
                {
                    "name": "inferbus-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.dir / "s3.json"
        config.write_text(json.dumps(identities))
        (self.dir / "master.toml").write_text(_WEED_MASTER_TOML)
        return config

    def _argv(self, base: int, config: Path, data: Path) -> list[str]:
        argv = [
            self.binary,
            "server",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-dir={data}",
            "-filer",
            "-s3",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=100",
            # Tests never need a graceful volume hand-over; without this a stop takes 10 s+.
            "-volume.preStopSeconds=0",
        ]
        argv += [f"-{name}={base + i}" for i, name in enumerate(_WEED_PORT_NAMES)]
        return argv

    def _accepts_credentials(self) -> bool:
        # Only our process knows these credentials, so success proves it is ours.
        import urllib3
        from minio import Minio
        from minio.error import S3Error
        from urllib3.exceptions import HTTPError

        if not _tcp_accepts(self.port):
            return False
        # Short timeouts and no retries: whatever holds the port may never answer.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=0.5, read=1.0), retries=urllib3.Retry(total=0)
        )
        client = Minio(
            self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
            http_client=http,
        )
        try:
            client.list_buckets()
        except (S3Error, HTTPError, OSError, ValueError):
            return False
        finally:
            http.clear()
        return True

    def _launch(self, base: int, timeout: float) -> bool:
        """Start with ports base..base+7; True when serving, False when a port was taken."""
        self.log_path.unlink(missing_ok=True)
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        self._base_port = base
        self.port = base + _WEED_PORT_NAMES.index("s3.port")
        child = self._spawn(self._argv(base, self._write_config(), data))
        try:
            if self._wait_for(child, self._accepts_credentials, timeout, "S3 list_buckets"):
                return True
        except BaseException:
            self._remove_sockets()
            raise
        self._remove_sockets()
        self._base_port = self.port = 0
        if "address already in use" in self.log_tail(20).lower():
            return False
        raise self._fail(f"exited with code {child.proc.returncode} during start-up")

    def start(self, timeout: float = 30.0) -> Self:
        """Start SeaweedFS with S3 and wait until our credentials list the buckets.

        Raises:
            ServerError: when it cannot start, bind, or serve within `timeout`.
        """
        if self.running:
            raise ServerError("s3: already running")
        started = time.monotonic()
        if self._base_port:
            base = self._base_port
            if not self._launch(base, timeout):
                raise self._fail(f"ports from {base} are taken; cannot restart")
        else:
            for _ in range(_BIND_ATTEMPTS):
                if self._launch(_random_port(len(_WEED_PORT_NAMES)), timeout):
                    break
            else:
                raise self._fail(f"no free ports after {_BIND_ATTEMPTS} attempts")
        self.start_seconds = time.monotonic() - started
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the server (its shutdown is slow; test data needs no grace, so 2 s at most)."""
        try:
            super().stop(timeout)
        finally:
            self._remove_sockets()

    def kill(self) -> None:
        """SIGKILL the server; its data dir is kept."""
        try:
            super().kill()
        finally:
            self._remove_sockets()

    def close(self) -> None:
        """Kill the server at once (its data is thrown away) and remove its temp dir."""
        if self._own_dir:
            self.kill()
        super().close()

    def _remove_sockets(self) -> None:
        # weed also serves each gRPC port on /tmp/seaweedfs-<part>-grpc-<port>.sock
        # (a fixed path, not configurable) and leaves them behind; the names carry
        # our ports, so these files are ours.
        if not self._base_port or self.running:
            return
        for i, name in enumerate(_WEED_PORT_NAMES):
            if name.endswith(".grpc"):
                part = name.split(".", 1)[0]
                Path(f"/tmp/seaweedfs-{part}-grpc-{self._base_port + i}.sock").unlink(
                    missing_ok=True
                )

    def restart(self, timeout: float = 30.0) -> Self:
        """Stop and start again on the same ports and data dir."""
        self.stop()
        return self.start(timeout)
