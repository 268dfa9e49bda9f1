"""``nats-server`` with JetStream: one server (`NatsServer`) or a three-node cluster
(`NatsCluster`)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

from inferbus_testing.servers.base import (
    _BIND_ATTEMPTS,
    _POLL_S,
    HOST,
    ServerError,
    _ChildProcess,
    _get_json,
    _random_port,
    _Server,
    find_binary,
)

if TYPE_CHECKING:
    pass


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

    def connections(self) -> str:
        """Who is connected and what each connection subscribes to (``/connz``), one
        line per connection: for a failure message when a message went missing
        (a connection nobody expected can hold a queue group's subscription)."""
        view = None
        if self.monitor_port:
            view = _get_json(self.monitor_port, "/connz?subs=detail&limit=1000")
        if view is None:
            return "<no /connz answer>"
        lines = []
        for conn in view.get("connections", []):
            subs = ", ".join(
                s["subject"] + (f" q={s['qgroup']}" if s.get("qgroup") else "")
                for s in conn.get("subscriptions_list_detail", [])
            )
            lines.append(
                f"cid={conn.get('cid')} name={conn.get('name', '')!r} port={conn.get('port')} "
                f"in={conn.get('in_msgs')} out={conn.get('out_msgs')} "
                f"pending={conn.get('pending_bytes')} "
                f"subs=[{subs}]"
            )
        return "\n".join(lines) or "<no connections>"

    def subscribers(self, subject: str) -> str:
        """The subscriptions nats-server's subscription list matches `subject` with now
        (``/subsz?test=``), and the list's counters: for a failure message when a
        message published on `subject` reached nobody."""
        if not self.monitor_port:
            return "<not started>"
        view = _get_json(self.monitor_port, f"/subsz?subs=1&test={subject}")
        if view is None:
            return "<no /subsz answer>"
        subs = ", ".join(
            f"cid={s.get('cid')} {s.get('subject')}"
            + (f" q={s['qgroup']}" if s.get("qgroup") else "")
            + f" msgs={s.get('msgs')}"
            for s in view.get("subscriptions_list", [])
        )
        counters = {k: view.get(k) for k in ("num_subscriptions", "num_cache", "num_matches")}
        return f"{subject} matches [{subs}]; {counters}"

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
        leaders = {str((v or {}).get("meta_cluster", {}).get("leader", "")) for v in views}
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
