"""Real servers for tests: ``nats-server`` (JetStream), ``redis-server`` and an S3 endpoint.

Each class starts the real binary as a child process bound to 127.0.0.1, waits
until it really serves (never a fixed sleep), and stops it again. Use them as
context managers or call ``start()``/``close()`` yourself::

    from inferbus_testing.servers import NatsServer, RedisServer, S3Server

    with NatsServer() as nats_srv:          # JetStream on, file store in a temp dir
        nc = await nats.connect(nats_srv.url)
        ...
        nats_srv.kill()                      # SIGKILL: simulate a crash
        nats_srv.restart()                   # same port, same store dir

    with RedisServer() as redis_srv:
        client = redis.Redis.from_url(redis_srv.url)

    with S3Server() as s3:                   # SeaweedFS, signature-checked
        client = minio.Minio(s3.endpoint, s3.access_key, s3.secret_key, secure=False)

In pytest, prefer the fixtures ``nats_server``, ``redis_server`` and
``s3_server`` from :mod:`inferbus_testing.fixtures`.

Ports: nats-server picks its own port (``-p -1``) and we read it back from its
ports file. redis-server and SeaweedFS cannot, so we choose a random port below
the kernel's ephemeral range (so it never collides with ports the OS hands out
for port 0 or outgoing connections) and retry with another one when the server
fails to bind. Readiness of those two is proven by something only *our*
process can produce (redis's "Ready to accept connections" in its own log; S3
accepting our freshly generated credentials), so a foreign server that already
holds the port is never mistaken for ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self

from inferbus_testing._children import die_with_parent

if TYPE_CHECKING:
    from minio import Minio

__all__ = [
    "NatsCluster",
    "NatsServer",
    "RedisServer",
    "S3Server",
    "ServerError",
    "find_binary",
]

HOST = "127.0.0.1"
"""Every server binds to the loopback address only."""

# Random ports for servers that cannot pick their own are drawn from here: above
# the well-known/registered ports in common use and below Linux's default
# ephemeral range (32768-60999), which the OS uses for port 0 and client sockets.
_RANDOM_PORT_LOW = 10_000
_RANDOM_PORT_HIGH = 32_000
_BIND_ATTEMPTS = 8
_POLL_S = 0.01


class ServerError(RuntimeError):
    """A test server failed to start or stop; the message ends with its log tail."""


def find_binary(name: str) -> str:
    """Find an executable next to the running interpreter (the venv's bin) or on PATH.

    Args:
        name: executable name, e.g. ``"nats-server"``.

    Returns:
        Absolute path of the executable.

    Raises:
        ServerError: when it is found in neither place.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServerError(
            f"{name!r} not found next to {sys.executable} nor on PATH "
            "(run scripts/bootstrap.sh to install it)"
        )
    return found


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "<no log>"
    return "\n".join(text.splitlines()[-lines:])


def _random_port(span: int = 1) -> int:
    # `span` consecutive ports starting at the returned one stay inside the range.
    return random.randrange(_RANDOM_PORT_LOW, _RANDOM_PORT_HIGH - span)


def _tcp_accepts(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def _get_json(port: int, path: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """GET ``http://127.0.0.1:PORT/PATH`` as JSON; None when it does not answer 200."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


class _ChildProcess:
    """One child process with its output in a log file; owns its process group."""

    def __init__(self, argv: Sequence[str], log_path: Path, cwd: Path, env: dict[str, str]):
        self.log_path = log_path
        log: IO[bytes] = log_path.open("ab")
        try:
            # A new session so that signals go to the server and anything it forks,
            # and so that a Ctrl-C in the terminal reaches pytest, not the servers.
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def stop(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        self.signal(signal.SIGKILL)
        return self.proc.wait()


class _Server:
    """Common lifecycle of the test servers: a temp dir, a child process, stop/close."""

    name = "server"

    def __init__(self, base_dir: Path | None) -> None:
        self._own_dir = base_dir is None
        if base_dir is None:
            base_dir = Path(tempfile.mkdtemp(prefix=f"ib-{self.name}-"))
        self.dir = base_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / f"{self.name}.log"
        self._child: _ChildProcess | None = None
        self.start_seconds = 0.0
        """Wall time the last successful start took (for reports and tuning)."""

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None when it is not running."""
        return self._child.pid if self._child is not None and self._child.alive() else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._child is not None and self._child.alive()

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of the server's log (stdout and stderr)."""
        return _tail(self.log_path, lines)

    def _fail(self, message: str) -> ServerError:
        return ServerError(
            f"{self.name}: {message}\n--- log tail ({self.log_path}) ---\n{self.log_tail()}"
        )

    def _spawn(self, argv: Sequence[str], env: dict[str, str] | None = None) -> _ChildProcess:
        child = _ChildProcess(argv, self.log_path, self.dir, {**os.environ, **(env or {})})
        self._child = child
        return child

    def _wait_for(
        self,
        child: _ChildProcess,
        ready: Callable[[], bool],
        timeout: float,
        what: str,
    ) -> bool:
        """Poll `ready` until it is true; False if the child exited first."""
        deadline = time.monotonic() + timeout
        while True:
            if not child.alive():
                return False
            if ready():
                return True
            if time.monotonic() >= deadline:
                child.kill()
                raise self._fail(f"not ready after {timeout:.1f}s (waiting for {what})")
            time.sleep(_POLL_S)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after `timeout`); its data dir is kept."""
        if self._child is not None:
            self._child.stop(timeout)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; its data dir is kept."""
        if self._child is not None:
            self._child.kill()

    def close(self) -> None:
        """Stop the server and remove its temp dir (when it created it)."""
        try:
            self.stop()
        finally:
            if self._own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, timeout: float = 20.0) -> Self:  # pragma: no cover - overridden
        raise NotImplementedError

    async def astart(self, timeout: float = 20.0) -> Self:
        """`start` in a worker thread, so an event loop keeps running meanwhile."""
        return await asyncio.to_thread(self.start, timeout)

    def __enter__(self) -> Self:
        if not self.running:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NatsServer(_Server):
    """A real ``nats-server`` with JetStream, on a port it picks itself.

    Args:
        base_dir: where the JetStream store, ports file and log live; a temp dir
            (removed by `close`) when None.
        jetstream: enable JetStream (``-js``).
        extra_args: more command-line arguments for nats-server.
    """

    name = "nats"

    def __init__(
        self,
        base_dir: Path | None = None,
        *,
        jetstream: bool = True,
        extra_args: Sequence[str] = (),
        server_name: str = "",
        cluster_name: str = "",
        cluster_port: int = 0,
        routes: Sequence[str] = (),
    ) -> None:
        super().__init__(base_dir)
        self.binary = find_binary("nats-server")
        self.jetstream = jetstream
        self.extra_args = tuple(extra_args)
        self.server_name = server_name
        """``--server_name`` (JetStream clustering needs a unique one per node)."""
        self.cluster_name = cluster_name
        """Cluster this node joins; empty: a single server."""
        self.cluster_port = cluster_port
        """Port of the cluster (route) listener, when in a cluster."""
        self.routes = list(routes)
        """Route URLs of every node of the cluster (this one's may be among them)."""
        self.store_dir = self.dir / "jetstream"
        self._ports_dir = self.dir / "ports"
        self.port = 0
        """Client port (0 until first started; kept across restarts)."""
        self.monitor_port = 0
        """HTTP monitoring port (/healthz, /varz, /jsz)."""

    @property
    def url(self) -> str:
        """Client URL, ``nats://127.0.0.1:PORT``."""
        if not self.port:
            raise ServerError("nats: not started yet")
        return f"nats://{HOST}:{self.port}"

    def start(self, timeout: float = 10.0) -> Self:
        """Start nats-server (on the previous port if it ran before) and wait until it serves.

        Raises:
            ServerError: when it exits or does not serve within `timeout` seconds.
        """
        started = time.monotonic()
        self.launch(timeout)
        remaining = max(0.1, timeout - (time.monotonic() - started))
        self.wait_healthy(remaining)
        self.start_seconds = time.monotonic() - started
        return self

    def launch(self, timeout: float = 10.0) -> _ChildProcess:
        """Start nats-server and wait for its listeners (not for JetStream).

        A cluster node is healthy only once a quorum of its cluster runs, so
        `NatsCluster` launches every node first and then waits for each.

        Raises:
            ServerError: when it exits first or has no listeners within `timeout`.
        """
        if self.running:
            raise ServerError("nats: already running")
        shutil.rmtree(self._ports_dir, ignore_errors=True)
        self._ports_dir.mkdir(parents=True)
        argv = [self.binary, "-a", HOST, "-p", str(self.port or -1), "-m", "-1"]
        argv += ["--ports_file_dir", str(self._ports_dir)]
        if self.server_name:
            argv += ["--server_name", self.server_name]
        if self.jetstream:
            argv += ["-js", "-sd", str(self.store_dir)]
        if self.cluster_name:
            argv += ["--cluster_name", self.cluster_name]
            argv += ["--cluster", f"nats://{HOST}:{self.cluster_port}"]
            argv += ["--routes", ",".join(self.routes)]
        argv += self.extra_args
        child = self._spawn(argv)
        ports_file = self._ports_dir / f"{Path(self.binary).name}_{child.pid}.ports"
        ports: dict[str, list[str]] = {}

        def read_ports() -> bool:
            # Written once the listeners are up, but not atomically: a reader can
            # see it empty or half-written, so only a complete JSON object counts.
            nonlocal ports
            try:
                ports = json.loads(ports_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return False
            return bool(ports.get("nats")) and bool(ports.get("monitoring"))

        if not self._wait_for(child, read_ports, timeout, "ports file"):
            raise self._fail(f"exited with code {child.proc.returncode} during start-up")
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
        return child

    def wait_healthy(self, timeout: float = 10.0) -> None:
        """Wait until ``/healthz`` says 200: JetStream up and, in a cluster, current.

        Raises:
            ServerError: when it exits first or is not healthy within `timeout`.
        """
        child = self._child
        if child is None or not self._wait_for(child, self._healthy, timeout, "/healthz"):
            code = child.proc.returncode if child is not None else None
            raise self._fail(f"exited with code {code} during start-up")

    def _healthy(self) -> bool:
        # /healthz answers 200 only once JetStream (when enabled) is ready too.
        try:
            with socket.create_connection((HOST, self.monitor_port), timeout=0.5) as sock:
                sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                head = sock.recv(64)
        except OSError:
            return False
        return head.startswith(b"HTTP/1.") and b" 200 " in head[:16]

    def restart(self, timeout: float = 10.0) -> Self:
        """Stop (gracefully, if still running) and start again on the same port and store."""
        self.stop()
        return self.start(timeout)

    async def arestart(self, timeout: float = 10.0) -> Self:
        """`restart` in a worker thread, so clients on the event loop can reconnect."""
        return await asyncio.to_thread(self.restart, timeout)


class NatsCluster:
    """Real ``nats-server`` nodes forming one cluster with clustered JetStream.

    Every node lists every node's route (nats-server refuses clustered
    JetStream otherwise), so the cluster ports are chosen before the start: at
    random below the ephemeral range, all nodes again on other ports when one
    cannot bind (as `RedisServer` does). Client and monitoring ports are
    picked by each node. A node killed or stopped comes back with `restart`
    on its ports and store, and rejoins::

        with NatsCluster(tmp_path, size=3) as cluster:
            nc = await nats.connect(cluster.urls)   # every node's client URL
            cluster.nodes[0].kill()
            cluster.restart(0)                      # waits until it is current

    Args:
        base_dir: one folder per node under it; a temp dir when None.
        size: number of nodes.
        name: the cluster's name (nodes are ``<name>-0``, ``<name>-1`` ...).
    """

    def __init__(self, base_dir: Path | None = None, *, size: int = 3, name: str = "ib") -> None:
        self._own_dir = base_dir is None
        self.dir = base_dir if base_dir is not None else Path(tempfile.mkdtemp(prefix="ib-natsc-"))
        self.name = name
        self.nodes = [
            NatsServer(self.dir / f"node{i}", server_name=f"{name}-{i}", cluster_name=name)
            for i in range(size)
        ]

    @property
    def running(self) -> bool:
        """True while every node runs."""
        return all(node.running for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        """Client URL of every node."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (the ``NATS_URL`` setting's form)."""
        return ",".join(self.urls)

    def node(self, server_name: str) -> NatsServer:
        """The node with this ``server_name``.

        Raises:
            KeyError: no node has that name.
        """
        for node in self.nodes:
            if node.server_name == server_name:
                return node
        raise KeyError(server_name)

    def index(self, server_name: str) -> int:
        """Position in `nodes` of the node with this ``server_name``."""
        return self.nodes.index(self.node(server_name))

    def start(self, timeout: float = 30.0) -> Self:
        """Start every node and wait until each is healthy (a meta leader elected).

        Raises:
            ServerError: a node exits or is not healthy within `timeout`, or no
                set of cluster ports could be bound.
        """
        for _ in range(_BIND_ATTEMPTS):
            base = _random_port(len(self.nodes))
            routes = [f"nats://{HOST}:{base + i}" for i in range(len(self.nodes))]
            for i, node in enumerate(self.nodes):
                node.cluster_port = base + i
                node.routes = routes
            try:
                for node in self.nodes:
                    node.launch(timeout)
            except ServerError:
                taken = any("address already in use" in n.log_tail(20) for n in self.nodes)
                self.stop()
                if taken:
                    continue
                raise
            break
        else:
            raise ServerError(f"nats cluster: no free cluster ports in {_BIND_ATTEMPTS} attempts")
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.wait_healthy(max(0.1, deadline - time.monotonic()))
        self.wait_meta(max(0.1, deadline - time.monotonic()))
        return self

    def meta_leader(self) -> str:
        """Server name of the JetStream meta leader, once every running node
        names the same one and it sees every other running node current; else ``""``."""
        running = [n for n in self.nodes if n.running]
        views = [_get_json(n.monitor_port, "/jsz") for n in running]
        leaders = {(v or {}).get("meta_cluster", {}).get("leader", "") for v in views}
        if len(leaders) != 1 or "" in leaders:
            return ""
        leader = leaders.pop()
        for node, view in zip(running, views, strict=True):
            if node.server_name != leader:
                continue
            replicas = (view or {}).get("meta_cluster", {}).get("replicas", [])
            current = {r["name"] for r in replicas if r.get("current")}
            if not {n.server_name for n in running} - {leader} <= current:
                return ""
        return leader

    def wait_meta(self, timeout: float = 30.0) -> str:
        """Wait for `meta_leader`; returns it.

        Raises:
            ServerError: no agreed, current meta leader within `timeout`.
        """
        deadline = time.monotonic() + timeout
        while True:
            leader = self.meta_leader()
            if leader:
                return leader
            if time.monotonic() > deadline:
                raise ServerError(f"nats cluster: no meta leader after {timeout:.1f}s")
            time.sleep(_POLL_S * 5)

    def restart(self, index: int, timeout: float = 30.0) -> NatsServer:
        """Start node `index` again (after a kill or stop) and wait until it is current."""
        started = time.monotonic()
        node = self.nodes[index]
        node.stop()
        node.start(timeout)
        self.wait_meta(max(0.1, timeout - (time.monotonic() - started)))
        return node

    async def stream_leader(self, stream: str) -> NatsServer:
        """The node that leads `stream` now (asked through any node that answers)."""
        import nats

        nc = await nats.connect(
            [n.url for n in self.nodes if n.running], connect_timeout=2, allow_reconnect=False
        )
        try:
            info = await nc.jetstream().stream_info(stream)
        finally:
            await nc.close()
        if info.cluster is None or not info.cluster.leader:
            raise ServerError(f"nats cluster: stream {stream} has no leader now")
        return self.node(info.cluster.leader)

    def stop(self) -> None:
        """Stop every node (their stores are kept)."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop every node and remove the temp dir (when it created it)."""
        try:
            for node in self.nodes:
                node.close()
        finally:
            if self._own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)

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
