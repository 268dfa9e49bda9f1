"""``inferbus up``: start NATS, Redis and every service on 127.0.0.1."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
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
        "router_metrics": args.router_metrics_port,
        "batcher_metrics": args.batcher_metrics_port,
        "worker_metrics": args.worker_metrics_port,
        "registry_grpc": args.registry_port,
        "registry_metrics": args.registry_metrics_port,
    }
    ports = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
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
        workers=args.workers,
        ports=ports,
        redis=not args.no_redis,
        pool=args.pool,
        timeout_s=args.timeout,
        log_level=args.log_level,
        llm_python=None if getattr(args, "no_llm", False) else find_vllm_python(),
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
        f"  KServe V2 HTTP : {ep.get('gateway_http', '-')}/v2/models/<model>/infer",
        f"  OpenAI API     : {ep.get('gateway_http', '-')}/v1 (generative models)",
        f"  registry gRPC  : {ep.get('registry', '-')}",
        f"  NATS           : {ep.get('nats', '-')} (monitoring {ep.get('nats_monitoring', '-')})",
        f"  Redis          : {ep.get('redis', 'not running')}",
        f"  metrics        : {ep.get('gateway_metrics', '-')} (gateway)",
    ]
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


def run(args: argparse.Namespace) -> int:
    """Start the stack; with ``-d`` return once it is up, else supervise it."""
    options = options_from_args(args)
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
            _say("inferbus is up:")
            for line in endpoint_lines(state):
                _say(line)
            if options.detached:
                _say(f"stop it with: inferbus down --home {home}")
                return 0
            _say("press Ctrl-C to stop")
        except KeyboardInterrupt:
            if not options.detached:
                stack.stop()
                remove_state(home)
            _err("interrupted")
            return 130
        return _supervise(stack, home)
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def _supervise(stack: Stack, home: Path) -> int:
    """Watch the children until Ctrl-C/SIGTERM; report every crash; then stop all."""
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
            dead = stack.crashed()
            for child in dead:
                _report_crash(child)
                crashed += 1
            if dead:
                save_state(home, stack.state())
                if all(c.record.exit_code is not None for c in stack.children):
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
