"""Starting, probing, restarting and stopping the processes of a local stack.

Every process runs in its own session (``start_new_session``): a Ctrl-C in the
terminal reaches only the CLI, which then stops the services in reverse start
order. A process is "up" when its ports are known and it answers: NATS its
``/healthz`` (with JetStream on; a cluster node once it is current), Redis a
PING, a service its ``/readyz`` (and the gateway ``/v2/health/live``).

`Stack.tend` is the supervisor's round: a process that exits is started again
on the ports it had, after a back-off that doubles with each quick crash
(`RestartPolicy`); `inferbus status` shows the restarts. With ``up -d`` the
supervisor is a process of its own (see `inferbus_cli.commands.up`).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferbus_cli import llm
from inferbus_cli.plan import (
    ProcessSpec,
    UpOptions,
    edge_spec,
    find_edge,
    find_nats_server,
    find_redis_server,
    nats_node_spec,
    nats_spec,
    pinned_spec,
    port_claims,
    process_stages,
    redis_spec,
    service_spec,
)
from inferbus_cli.probes import (
    check_ports_free,
    http_json,
    http_status,
    read_ports_file,
    redis_ping,
)
from inferbus_cli.state import (
    ProcessRecord,
    StackState,
    is_alive,
    last_log_lines,
    process_start_ticks,
    signal_process,
)

POLL_S = 0.05
#: After a service answers /readyz, how long to wait for it to say "ready".
READY_GRACE_S = 5.0
#: Cluster ports under --free-ports are drawn from here (below Linux's ephemeral
#: range, which the OS uses for port 0), and drawn again when one is taken.
_RANDOM_PORT_LOW, _RANDOM_PORT_HIGH = 10_000, 32_000
_CLUSTER_PORT_ATTEMPTS = 8

Say = Callable[[str], None]


class StartupError(Exception):
    """A process did not come up.

    Args:
        name: the process.
        reason: what went wrong.
        exit_code: its exit status if it exited.
        log_tail: its last log lines.
    """

    def __init__(
        self, name: str, reason: str, exit_code: int | None = None, log_tail: Sequence[str] = ()
    ) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason
        self.exit_code = exit_code
        self.log_tail = list(log_tail)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a crashed process is started again.

    The first restart waits `initial_s`; each further crash within `stable_s`
    of the last start doubles the wait, up to `max_s`. A process that stayed up
    for `stable_s` starts over at `initial_s`.
    """

    initial_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, streak: int) -> float:
        """Seconds to wait before restart number `streak` (1-based) of a crash series."""
        return min(self.max_s, self.initial_s * 2 ** max(0, streak - 1))


@dataclass(slots=True)
class Child:
    """A process this CLI started, its spec and what is known about it."""

    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    record: ProcessRecord
    started: float = 0.0
    """When it was launched (monotonic)."""
    streak: int = 0
    """Crashes in the current series (see `RestartPolicy`)."""
    due: float | None = None
    """When it is to be started again (monotonic), once it has crashed."""

    def poll(self) -> int | None:
        """Exit status once it has exited (reaping it), else None."""
        code = self.popen.poll()
        if code is not None:
            self.record.exit_code = code
        return code


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` for a Popen return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(spec: ProcessSpec) -> Child:
    """Start one process in its own session, output appended to its log file."""
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    if spec.ports_file is not None:
        spec.ports_file.unlink(missing_ok=True)
    with open(spec.log, "ab") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log.write(f"----- inferbus up: starting {spec.name} at {stamp}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            spec.argv,
            env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    record = ProcessRecord(
        name=spec.name,
        pid=popen.pid,
        start_ticks=process_start_ticks(popen.pid),
        argv=spec.argv,
        log=str(spec.log),
    )
    return Child(spec, popen, record, started=time.monotonic())


def _nats_ports(run_dir: Path, pid: int) -> dict[str, int] | None:
    # nats-server names its ports file <executable>_<pid>.ports.
    for path in run_dir.glob(f"*_{pid}.ports"):
        data = read_ports_file(path)
        if data and data.get("nats") and data.get("monitoring"):
            ports = {
                "client": int(data["nats"][0].rsplit(":", 1)[1]),
                "monitoring": int(data["monitoring"][0].rsplit(":", 1)[1]),
            }
            if data.get("cluster"):
                ports["cluster"] = int(data["cluster"][0].rsplit(":", 1)[1])
            return ports
    return None


def _probe(child: Child, run_dir: Path) -> dict[str, Any] | None:
    """The process's ports once it answers, else None (one non-blocking attempt)."""
    spec = child.spec
    if spec.kind == "nats":
        ports = _nats_ports(run_dir, child.popen.pid)
        if ports and http_status(ports["monitoring"], spec.health_path) == 200:
            return ports
        return None
    if spec.kind == "redis":
        if not redis_ping(spec.redis_address):
            return None
        if spec.redis_address.startswith("/"):
            return {"unix": spec.redis_address}
        return {"redis": int(spec.redis_address.rsplit(":", 1)[1])}
    assert spec.ports_file is not None
    data = read_ports_file(spec.ports_file)
    if not data or data.get("pid") != child.popen.pid or "metrics" not in data:
        return None
    if http_status(int(data["metrics"]), "/readyz") is None:
        return None
    if spec.name.startswith("gateway") and http_status(int(data["http"]), "/v2/health/live") != 200:
        return None
    return {k: v for k, v in data.items() if k != "pid"}


def wait_up(child: Child, run_dir: Path, timeout_s: float, say: Say) -> dict[str, Any]:
    """Poll until the process is up; returns its ports.

    Raises:
        StartupError: if it exits first or the timeout passes.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        code = child.poll()
        if code is not None:
            raise StartupError(
                child.spec.name,
                f"exited during start-up ({describe_exit(code)})",
                code,
                last_log_lines(child.spec.log),
            )
        ports = _probe(child, run_dir)
        if ports is not None:
            break
        if time.monotonic() > deadline:
            raise StartupError(
                child.spec.name,
                f"not up after {timeout_s:g}s",
                None,
                last_log_lines(child.spec.log),
            )
        time.sleep(POLL_S)
    if child.spec.kind == "service":
        _wait_ready(child, int(ports["metrics"]), min(READY_GRACE_S, timeout_s), say)
    return ports


def _wait_ready(child: Child, metrics_port: int, grace_s: float, say: Say) -> None:
    """Give a service that answers /readyz a moment to report ready; warn if not."""
    deadline = time.monotonic() + grace_s
    while http_status(metrics_port, "/readyz") != 200:
        if time.monotonic() > deadline or child.poll() is not None:
            body = http_json(metrics_port, "/readyz") or {}
            reason = body.get("reason", "") if isinstance(body, dict) else ""
            say(f"  note: {child.spec.name} is up but not ready yet: {reason or 'no reason given'}")
            return
        time.sleep(POLL_S)


def stop_pid(
    name: str,
    pid: int,
    start_ticks: int,
    timeout_s: float,
    say: Say,
    poll: Callable[[], int | None] | None = None,
) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL.

    Args:
        name: for messages.
        pid: the process (and its group when it leads one).
        start_ticks: its recorded start time, so a reused pid is never signalled.
        timeout_s: grace period before SIGKILL.
        say: where messages go.
        poll: for our own children, `Popen.poll` (reaps; a zombie counts as exited).
    """

    def alive() -> bool:
        if poll is not None:
            return poll() is None
        return is_alive(pid, start_ticks)

    if not alive():
        return
    signal_process(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive():
        if time.monotonic() > deadline:
            say(f"  {name} (pid {pid}) did not stop within {timeout_s:g}s; sending SIGKILL")
            signal_process(pid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while alive() and time.monotonic() < kill_deadline:
                time.sleep(POLL_S)
            return
        time.sleep(POLL_S)


class Stack:
    """The processes of one `inferbus up`, started in order and stopped in reverse.

    Args:
        options: what to start.
        say: where progress messages go.
    """

    def __init__(self, options: UpOptions, say: Say, policy: RestartPolicy | None = None) -> None:
        self.options = options
        self.say = say
        self.policy = policy or RestartPolicy()
        self.children: list[Child] = []
        self.endpoints: dict[str, str] = {}
        self.started_unix = time.time()
        self._nats_urls: dict[str, str] = {}

    def preflight(self) -> tuple[str, str | None]:
        """Find the binaries and check every fixed port is free, before starting anything.

        Returns:
            (nats-server path, redis-server path or None when Redis is skipped).

        Raises:
            StartupError: nats-server is missing.
            PortInUseError: a fixed port is taken.
        """
        nats = find_nats_server()
        if nats is None:
            raise StartupError(
                "nats", "nats-server not found next to this Python or on PATH (run uv sync)"
            )
        redis = None
        if self.options.redis:
            redis = find_redis_server()
            if redis is None:
                self.say(
                    "warning: redis-server not found on PATH; starting without Redis "
                    "(no cluster-wide rate limits or quotas). Install it with: "
                    "sudo apt-get install -y redis-server"
                )
        if self.options.edge and find_edge() is None:
            raise StartupError(
                "edge",
                "inferbus-edge not found next to this Python or on PATH: build it with "
                "scripts/build-edge.sh --install-deps (Debian's Go toolchain)",
            )
        check_ports_free(port_claims(self.options, with_redis=redis is not None))
        return nats, redis

    def start(self) -> None:
        """Start every process in order, waiting for each to be up.

        On failure the processes already started are stopped again.

        Raises:
            StartupError: naming the process that failed, with its log tail.
            PortInUseError: a fixed port is taken (nothing was started).
        """
        nats_bin, redis_bin = self.preflight()
        for d in (self.options.logs_dir, self.options.run_dir, self.options.home / "nats"):
            d.mkdir(parents=True, exist_ok=True)
        try:
            for stage in process_stages(self.options, with_redis=redis_bin is not None):
                if stage == self.options.nats_names and self.options.nats_cluster > 1:
                    self._start_nats_cluster(nats_bin)
                    continue
                specs = []
                for name in stage:
                    if name == "nats":
                        specs.append(nats_spec(self.options, nats_bin))
                    elif name == "redis":
                        assert redis_bin is not None
                        (self.options.home / "redis").mkdir(parents=True, exist_ok=True)
                        specs.append(redis_spec(self.options, redis_bin))
                    elif name == "edge":
                        edge_bin = find_edge()
                        assert edge_bin is not None  # preflight checked
                        specs.append(edge_spec(self.options, edge_bin, self.endpoints))
                    else:
                        specs.append(service_spec(self.options, name, self.endpoints))
                self._start_stage(specs)
            if self.options.llm_python is not None:
                self._push_tiny_llm()
        except BaseException:
            # Covers Ctrl-C during start-up as well: never leave half a stack.
            self.stop()
            raise

    def _push_tiny_llm(self) -> None:
        """Build (once) and push the tiny generative model for the LLM worker.

        Raises:
            StartupError: building or pushing failed.
        """
        assert self.options.llm_python is not None
        self.say(f"  pushing {llm.TINY_MODEL} (tiny offline Llama) ...")
        try:
            out = self.options.home / "tiny-llm"
            model_dir = llm.build_tiny_model(self.options.llm_python, out)
            llm.push_tiny_model(self.endpoints["registry"], model_dir, self.say)
        except RuntimeError as exc:
            raise StartupError("llm-worker", str(exc)) from None

    def _start_nats_cluster(self, binary: str) -> None:
        """Start every NATS node at once; each is up once a quorum has formed.

        Under --free-ports the cluster ports are drawn at random (every node
        must know every node's route before it starts) and drawn again when a
        node cannot bind one.
        """
        nodes = self.options.nats_cluster
        for attempt in range(_CLUSTER_PORT_ATTEMPTS):
            fixed = [self.options.ports.nats_node(i)[2] for i in range(nodes)]
            if all(fixed):
                cluster_ports = fixed
            else:
                base = random.randrange(_RANDOM_PORT_LOW, _RANDOM_PORT_HIGH - nodes)
                cluster_ports = [base + i for i in range(nodes)]
            specs = [nats_node_spec(self.options, binary, i, cluster_ports) for i in range(nodes)]
            try:
                self._start_stage(specs)
                return
            except StartupError as exc:
                taken = any("address already in use" in line for line in exc.log_tail)
                if all(fixed) or not taken or attempt == _CLUSTER_PORT_ATTEMPTS - 1:
                    raise
                self.say("  a cluster port was taken; trying others")
                names = {s.name for s in specs}
                for child in [c for c in self.children if c.spec.name in names]:
                    stop_pid(
                        child.spec.name,
                        child.popen.pid,
                        child.record.start_ticks,
                        5.0,
                        self.say,
                        poll=child.poll,
                    )
                    self.children.remove(child)

    def _start_stage(self, specs: list[ProcessSpec]) -> None:
        """Launch every spec at once, then wait for each to be up."""
        children = []
        for spec in specs:
            self.say(f"  starting {spec.name} ...")
            child = launch(spec)
            self.children.append(child)
            children.append(child)
        for child in children:
            ports = wait_up(child, self.options.run_dir, self.options.timeout_s, self.say)
            child.record.ports = ports
            self._learn_endpoints(child.spec.name, ports)
            shown = " ".join(f"{k}={v}" for k, v in ports.items())
            self.say(f"  {child.spec.name} up (pid {child.popen.pid}) {shown}")

    def _learn_endpoints(self, name: str, ports: dict[str, Any]) -> None:
        ep = self.endpoints
        if name == "nats" or name.startswith("nats-"):
            # Every node's URL, in node order: what services and the CLI connect to.
            self._nats_urls[name] = f"nats://127.0.0.1:{ports['client']}"
            ep["nats"] = ",".join(self._nats_urls[n] for n in sorted(self._nats_urls))
            if name in ("nats", "nats-1"):
                ep["nats_monitoring"] = f"http://127.0.0.1:{ports['monitoring']}"
        elif name == "redis":
            ep["redis"] = ports.get("unix") or f"127.0.0.1:{ports['redis']}"
        elif name == "registry":
            ep["registry"] = f"127.0.0.1:{ports['grpc']}"
            ep["registry_metrics"] = f"http://127.0.0.1:{ports['metrics']}/metrics"
        elif name == "gateway":
            ep["gateway_grpc"] = f"127.0.0.1:{ports['grpc']}"
            ep["gateway_http"] = f"http://127.0.0.1:{ports['http']}"
            ep["gateway_metrics"] = f"http://127.0.0.1:{ports['metrics']}/metrics"
        elif name == "edge":
            ep["edge_grpc"] = f"127.0.0.1:{ports['grpc']}"
            ep["edge_metrics"] = f"http://127.0.0.1:{ports['metrics']}/metrics"
        elif "metrics" in ports:
            ep[f"{name}_metrics"] = f"http://127.0.0.1:{ports['metrics']}/metrics"

    def state(self) -> StackState:
        """The state to write to `state.json`."""
        return StackState(
            home=str(self.options.home),
            started_unix=self.started_unix,
            detached=self.options.detached,
            supervisor_pid=os.getpid(),
            processes=[c.record for c in self.children],
            endpoints=dict(self.endpoints),
            stack_id=self.options.stack_id,
        )

    def crashed(self) -> list[Child]:
        """Children that exited since the last call (each reported once)."""
        out = []
        for child in self.children:
            if child.record.exit_code is None and child.poll() is not None:
                out.append(child)
        return out

    def tend(self, restart: bool = True) -> tuple[list[Child], list[Child]]:
        """One supervisor round: note crashes, start again those whose back-off is over.

        A restarted process gets the ports it had, so clients and the other
        services find it where it was. A restart that fails to come up counts
        as one more crash of the series.

        Args:
            restart: schedule restarts (False: only report crashes).

        Returns:
            (children that crashed since the last round, children restarted in this one).
        """
        now = time.monotonic()
        crashed = self.crashed()
        for child in crashed:
            if not restart:
                continue
            stable = now - child.started >= self.policy.stable_s
            child.streak = 1 if stable else child.streak + 1
            delay = self.policy.delay(child.streak)
            child.due = now + delay
            child.record.restarting_at = time.time() + delay
        restarted = []
        for i, child in enumerate(self.children):
            if child.due is None or now < child.due:
                continue
            fresh = self._relaunch(child)
            self.children[i] = fresh
            if fresh.record.exit_code is None:
                restarted.append(fresh)
        return crashed, restarted

    def _relaunch(self, old: Child) -> Child:
        """Start `old`'s process again on its ports; a failed start is scheduled again."""
        spec = pinned_spec(old.spec, old.record.ports)
        self.say(f"  restarting {spec.name} (restart {old.record.restarts + 1})")
        child = launch(spec)
        child.streak = old.streak
        child.record.restarts = old.record.restarts + 1
        child.record.last_exit = describe_exit(old.record.exit_code or 0)
        try:
            ports = wait_up(child, self.options.run_dir, self.options.timeout_s, self.say)
        except StartupError as exc:
            self.say(f"  {spec.name} did not come back: {exc.reason}")
            stop_pid(
                spec.name, child.popen.pid, child.record.start_ticks, 5.0, self.say, child.poll
            )
            child.poll()  # reaps it and records its exit code: not reported as a new crash
            child.streak += 1
            delay = self.policy.delay(child.streak)
            child.due = time.monotonic() + delay
            child.record.restarting_at = time.time() + delay
            child.record.ports = old.record.ports
            return child
        child.record.ports = ports
        self.say(f"  {spec.name} up again (pid {child.popen.pid})")
        return child

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every child in reverse start order (SIGTERM, then SIGKILL)."""
        for child in reversed(self.children):
            child.due = None
            if child.popen.poll() is not None:
                child.record.exit_code = child.popen.returncode
                continue
            self.say(f"  stopping {child.spec.name} (pid {child.popen.pid})")
            stop_pid(
                child.spec.name,
                child.popen.pid,
                child.record.start_ticks,
                timeout_s,
                self.say,
                poll=child.poll,
            )
