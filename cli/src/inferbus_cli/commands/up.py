"""``inferbus up``: start NATS, Redis and every service on 127.0.0.1, and supervise them.

In the foreground the CLI process is the supervisor. With ``-d`` it starts the
supervisor as a background process of its own (``up ... --supervisor``,
output in ``<home>/logs/supervisor.log``), relays its start-up and returns once
the stack is up; ``inferbus down`` stops the supervisor, which stops the rest.
Either way a service that crashes is started again (`supervisor.Stack.tend`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import FrameType

from inferbus_cli.llm import find_vllm_python
from inferbus_cli.plan import Ports, S3Options, UpOptions
from inferbus_cli.probes import PortInUseError
from inferbus_cli.state import (
    StackState,
    is_alive,
    last_log_lines,
    load_state,
    remove_state,
    resolve_home,
    save_state,
)
from inferbus_cli.supervisor import Child, Stack, StartupError, describe_exit
from inferbus_cli.torchenv import find_torch_python
from inferbus_common import gpus
from inferbus_common.errors import InferbusError, InvalidArgument

WATCH_INTERVAL_S = 0.2
#: Log lines shown when a service fails or crashes.
TAIL_LINES = 15


def options_from_args(args: argparse.Namespace) -> UpOptions:
    """Turn parsed ``up`` arguments into `UpOptions`."""
    base = Ports(**dict.fromkeys(Ports.__dataclass_fields__, 0)) if args.free_ports else Ports()
    given = {
        "nats": args.nats_port,
        "nats_monitor": args.nats_monitor_port,
        "redis": args.redis_port,
        "gateway_http": args.http_port,
        "gateway_grpc": args.grpc_port,
        "gateway_metrics": args.metrics_port,
        "edge_grpc": args.edge_port,
        "edge_metrics": args.edge_metrics_port,
        "router_metrics": args.router_metrics_port,
        "batcher_metrics": args.batcher_metrics_port,
        "worker_metrics": args.worker_metrics_port,
        "registry_grpc": args.registry_port,
        "registry_metrics": args.registry_metrics_port,
        "nats_cluster": args.nats_cluster_port,
    }
    ports = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    workers = args.workers
    gpu_uuids: tuple[str, ...] = ()
    if getattr(args, "gpus", None):
        if args.workers != 1:
            raise InvalidArgument(
                "--gpus starts one worker per GPU: leave --workers out (or use --workers "
                "without --gpus)"
            )
        gpu_uuids = tuple(g.uuid for g in gpus.select_gpus(args.gpus, gpus.host_gpus()))
        workers = len(gpu_uuids)
    return UpOptions(
        home=resolve_home(args.home),
        detached=args.detach,
        store=args.store,
        s3=S3Options(
            endpoint=args.s3_endpoint,
            access_key=args.s3_access_key,
            secret_key=args.s3_secret_key,
            bucket=args.s3_bucket,
            secure=args.s3_secure,
        ),
        workers=workers,
        gateways=args.gateways,
        ports=ports,
        redis=not args.no_redis,
        pool=args.pool,
        timeout_s=args.timeout,
        log_level=args.log_level,
        llm_python=None if getattr(args, "no_llm", False) else find_vllm_python(),
        worker_python=find_torch_python(),
        nats_cluster=args.nats_cluster,
        gpus=gpu_uuids,
        stack_id=uuid.uuid4().hex[:12],
        edge=args.edge,
    )


def _say(line: str) -> None:
    print(line, flush=True)


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def running_elsewhere(state: StackState) -> list[str]:
    """Names of recorded processes (and supervisor) that still run."""
    alive = [p.name for p in state.processes if is_alive(p.pid, p.start_ticks)]
    if state.supervisor_pid and is_alive(state.supervisor_pid):
        alive.append(f"supervisor (pid {state.supervisor_pid})")
    return alive


def endpoint_lines(state: StackState) -> list[str]:
    """Human-readable list of where to call the stack."""
    ep = state.endpoints
    lines = [
        f"  KServe V2 gRPC : {ep.get('gateway_grpc', '-')}",
    ]
    if "edge_grpc" in ep:
        lines.append(
            f"                   {ep['edge_grpc']} (edge: unary calls over NATS to every gateway)"
        )
    lines += [
        f"  KServe V2 HTTP : {ep.get('gateway_http', '-')}/v2/models/<model>/infer",
        f"  OpenAI API     : {ep.get('gateway_http', '-')}/v1 (generative models)",
        f"  registry gRPC  : {ep.get('registry', '-')}",
        f"  NATS           : {ep.get('nats', '-')} (monitoring {ep.get('nats_monitoring', '-')})",
        f"  Redis          : {ep.get('redis', 'not running')}",
        f"  metrics        : {ep.get('gateway_metrics', '-')} (gateway)",
    ]
    if "gateway-2_metrics" in ep:
        group = ep["gateway_metrics"].removesuffix("/metrics") + "/metrics/group"
        lines.append(f"                   {group} (every gateway process, labelled)")
    lines += [
        f"                   {url} ({key.removesuffix('_metrics')})"
        for key, url in ep.items()
        if key.endswith("_metrics") and key != "gateway_metrics"
    ]
    lines.append(f"  logs           : {Path(state.home) / 'logs'}")
    return lines


def _report_failure(exc: StartupError, home: Path) -> None:
    _err(f"error: {exc.name} failed to start: {exc.reason}")
    if exc.log_tail:
        _err(f"--- last lines of {home / 'logs' / (exc.name + '.log')}:")
        for line in exc.log_tail:
            _err(f"    {line}")


def _report_crash(child: Child) -> None:
    code = child.record.exit_code
    how = describe_exit(code) if code is not None else "exited"
    _err(f"error: {child.spec.name} (pid {child.record.pid}) stopped: {how}")
    lines = last_log_lines(child.spec.log, TAIL_LINES)
    if lines:
        _err(f"--- last lines of {child.spec.log}:")
        for line in lines:
            _err(f"    {line}")
    if child.due is not None:
        wait = max(0.0, child.record.restarting_at - time.time())
        _err(f"  restarting {child.spec.name} in {wait:.1f}s")


def run(args: argparse.Namespace) -> int:
    """Start the stack and supervise it; with ``-d`` the supervisor runs in the background."""
    try:
        options = options_from_args(args)
    except InferbusError as exc:
        _err(f"error: {exc.message}")
        return 1
    home = options.home
    try:
        previous = load_state(home)
    except ValueError as exc:
        _err(f"error: {exc}")
        return 1
    if previous is not None:
        alive = running_elsewhere(previous)
        if alive:
            _err(
                f"error: a stack is already running from {home} ({', '.join(alive)}); "
                f"see `inferbus status --home {home}` or stop it with `inferbus down --home {home}`"
            )
            return 1
        remove_state(home)
    if options.detached and not args.supervisor:
        return _run_detached(options, args.argv)

    _say(f"inferbus: starting a local stack in {home}")
    stack = Stack(options, _say)
    # Until the supervisor loop runs, SIGTERM behaves like Ctrl-C: Stack.start
    # stops whatever it had already started, and so does the handler below.
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            stack.start()
        except PortInUseError as exc:
            _err(f"error: {exc}")
            return 2
        except (StartupError, ValueError) as exc:
            if isinstance(exc, StartupError):
                _report_failure(exc, home)
            else:
                _err(f"error: {exc}")
            _err(f"logs: {options.logs_dir}")
            return 1
        except KeyboardInterrupt:
            _err("interrupted; stopped what had started")
            return 130
        try:
            state = stack.state()
            save_state(home, state)
            _say(READY_LINE)
            for line in endpoint_lines(state):
                _say(line)
            if options.detached:
                _say(f"supervising (pid {os.getpid()}); stop with: inferbus down --home {home}")
            else:
                _say("press Ctrl-C to stop")
        except KeyboardInterrupt:
            stack.stop()
            remove_state(home)
            _err("interrupted")
            return 130
        return _supervise(stack, home, restart=not args.no_restart)
    finally:
        signal.signal(signal.SIGTERM, previous_term)


#: Printed once the state is saved; `_run_detached` relays the supervisor's output up to it.
READY_LINE = "inferbus is up:"


def _run_detached(options: UpOptions, command: list[str]) -> int:
    """Start the supervisor in the background, relay its start-up, return once it is up.

    Args:
        options: what to start.
        command: this ``up -d`` command line; the supervisor runs the same
            with ``--supervisor`` (and the home made absolute).
    """
    home = options.home
    options.logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = options.logs_dir / "supervisor.log"
    argv = [sys.executable, "-m", "inferbus_cli", *command, "--home", str(home), "--supervisor"]
    with open(log_path, "ab") as log:
        offset = log.tell()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    relay = _LogRelay(log_path, offset)
    # Each process has its own start-up timeout in the supervisor; this only
    # guards against a supervisor that hangs.
    deadline = time.monotonic() + options.timeout_s * 6 + 60
    try:
        while True:
            relay.pump()
            code = child.poll()
            if code is not None:
                relay.pump(final=True)
                _err(f"error: the supervisor exited ({describe_exit(code)}); log: {log_path}")
                return code or 1
            state = _ready_state(home, child.pid)
            if state is not None:
                relay.pump()
                break
            if time.monotonic() > deadline:
                child.terminate()
                _err(f"error: the stack did not come up; log: {log_path}")
                return 1
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        # The supervisor stops what it had started on SIGTERM.
        child.terminate()
        child.wait()
        _err("interrupted; stopped what had started")
        return 130
    _say(READY_LINE)
    for line in endpoint_lines(state):
        _say(line)
    _say(
        f"supervised in the background (pid {child.pid}): crashed services are restarted; "
        f"log {log_path}"
    )
    _say(f"stop it with: inferbus down --home {home}")
    return 0


def _ready_state(home: Path, supervisor_pid: int) -> StackState | None:
    """The state the background supervisor saved once everything was up, if it has."""
    try:
        state = load_state(home)
    except ValueError:
        return None
    if state is None or state.supervisor_pid != supervisor_pid:
        return None
    return state


class _LogRelay:
    """Prints what the background supervisor writes to its log, up to `READY_LINE`."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset
        self.partial = ""
        self.done = False
        self.errors = False

    def pump(self, final: bool = False) -> None:
        if self.done:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        text = self.partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        for line in lines:
            if line == READY_LINE:
                self.done = True
                return
            if line.startswith("error:"):
                self.errors = True
            if line:
                (_err if self.errors else _say)(line)


def _supervise(stack: Stack, home: Path, *, restart: bool = True) -> int:
    """Watch the children until Ctrl-C/SIGTERM; report and restart every crash; then stop all."""
    stopping: list[int] = []

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    # SIGHUP too: the services run in their own sessions, so a closed terminal
    # would otherwise leave them running without a supervisor.
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, request_stop) for sig in handled}
    crashed = 0
    try:
        while not stopping:
            dead, back = stack.tend(restart=restart)
            for child in dead:
                _report_crash(child)
                crashed += 1
            if dead or back:
                save_state(home, stack.state())
                if all(c.record.exit_code is not None and c.due is None for c in stack.children):
                    _err("error: every process has stopped")
                    break
            time.sleep(WATCH_INTERVAL_S)
        _say("stopping ...")
        stack.stop()
    finally:
        remove_state(home)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say("stopped")
    return 1 if crashed else 0
