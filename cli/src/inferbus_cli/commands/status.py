"""``inferbus status``: every process of the stack and every model's readiness."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc

from inferbus_cli.rpc import (
    inference_stub,
    open_channel,
    registry_channel,
    registry_stub,
    rpc_error_text,
)
from inferbus_cli.state import StackState, is_alive, last_log_lines, load_state, resolve_home
from inferbus_cli.supervisor import describe_exit
from inferbus_cli.table import format_table
from inferbus_proto.registry import registry_pb2 as rpb
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

RPC_TIMEOUT_S = 3.0


def process_rows(state: StackState) -> list[dict[str, Any]]:
    """One dict per process: name, pid, alive, ports, log, restarts and, when dead, a hint.

    ``restarting_in_s`` is set while the supervisor waits to start a crashed
    process again; ``last_exit`` says how the process before the last restart ended.
    """
    rows = []
    supervised = bool(state.supervisor_pid) and is_alive(state.supervisor_pid)
    for proc in state.processes:
        alive = is_alive(proc.pid, proc.start_ticks)
        row: dict[str, Any] = {
            "name": proc.name,
            "pid": proc.pid,
            "alive": alive,
            "ports": proc.ports,
            "log": proc.log,
            "restarts": proc.restarts,
            "last_exit": proc.last_exit,
        }
        if not alive:
            hint = describe_exit(proc.exit_code) if proc.exit_code is not None else "not running"
            if supervised and proc.restarting_at:
                row["restarting_in_s"] = round(max(0.0, proc.restarting_at - time.time()), 1)
                hint += f"; restarting in {row['restarting_in_s']:g}s"
            tail = last_log_lines(proc.log, 1)
            row["hint"] = hint + (f"; last log line: {tail[0]}" if tail else "")
        rows.append(row)
    return rows


def model_rows(state: StackState) -> tuple[list[dict[str, Any]], list[str]]:
    """Models from the registry with the gateway's readiness; plus any errors."""
    errors: list[str] = []
    registry = state.endpoints.get("registry")
    gateway = state.endpoints.get("gateway_grpc")
    if not registry:
        return [], ["the state has no registry address"]
    with registry_channel(registry) as channel:
        try:
            listed = registry_stub(channel).ListModels(
                rpb.ListModelsRequest(), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            return [], [f"registry ListModels: {rpc_error_text(exc, registry)}"]
    rows: list[dict[str, Any]] = [
        {
            "name": m.name,
            "versions": list(m.versions),
            "aliases": dict(m.aliases),
            "ready": None,
            "versions_ready": {},
        }
        for m in listed.models
    ]
    if not gateway:
        return rows, ["the state has no gateway address"]
    with open_channel(gateway) as channel:
        stub = inference_stub(channel)
        for row in rows:
            try:
                row["ready"] = stub.ModelReady(
                    pb.ModelReadyRequest(name=row["name"]), timeout=RPC_TIMEOUT_S
                ).ready
                for version in row["versions"]:
                    row["versions_ready"][version] = stub.ModelReady(
                        pb.ModelReadyRequest(name=row["name"], version=version),
                        timeout=RPC_TIMEOUT_S,
                    ).ready
            except grpc.RpcError as exc:
                errors.append(f"gateway ModelReady {row['name']}: {rpc_error_text(exc, gateway)}")
                break
        reasons = version_reasons(stub)
    for row in rows:
        row["versions_reason"] = {
            v: reasons[(row["name"], v)]
            for v, ready in row["versions_ready"].items()
            if not ready and (row["name"], v) in reasons
        }
    return rows, errors


def version_reasons(stub: Any) -> dict[tuple[str, str], str]:
    """(model, version) → why it is not ready, from the gateway's repository index
    (``no worker (last served by worker ... : ... s ago ...)``, ``loading``, ``failed:
    ...``); empty when the gateway has no repository extension."""
    try:
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError:
        return {}  # the extension is off (no registry URL): readiness alone
    return {
        (m.name, m.version): f"{m.state}: {m.reason}" if m.reason else m.state
        for m in index.models
        if m.state != "READY"
    }


def _state_text(row: dict[str, Any]) -> str:
    if row["alive"]:
        return "alive"
    return "RESTARTING" if "restarting_in_s" in row else "DEAD"


def _ports_text(ports: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in ports.items()) or "-"


def _shorten(text: str, width: int = 140) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def run(args: argparse.Namespace) -> int:
    """Print the stack's status; exit 1 when a process is down or unreachable."""
    home = resolve_home(args.home)
    try:
        state = load_state(home)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if state is None:
        if args.json:
            print(json.dumps({"home": str(home), "running": False}))
        else:
            print(f"not running: no state.json in {home} (start with `inferbus up`)")
        return 1
    procs = process_rows(state)
    models, errors = model_rows(state)
    down = [p["name"] for p in procs if not p["alive"]]
    healthy = not down and not errors
    if args.json:
        doc = {
            "home": str(home),
            "running": True,
            "healthy": healthy,
            "processes": procs,
            "models": models,
            "endpoints": state.endpoints,
            "errors": errors,
        }
        print(json.dumps(doc, indent=2))
        return 0 if healthy else 1
    rows = [
        [
            p["name"],
            p["pid"],
            _state_text(p),
            p["restarts"] or "-",
            _ports_text(p["ports"]) if p["alive"] else _shorten(p.get("hint", "")),
        ]
        for p in procs
    ]
    print(format_table(["PROCESS", "PID", "STATE", "RESTARTS", "PORTS"], rows))
    who = "in the foreground" if not state.detached else "in the background"
    if state.supervisor_pid and is_alive(state.supervisor_pid):
        print(f"supervisor: pid {state.supervisor_pid} ({who}); crashed processes are restarted")
    else:
        print("supervisor: not running (crashed processes stay down)")
    print()
    if models:
        mrows = [
            [
                m["name"],
                ",".join(m["versions"]) or "-",
                ",".join(f"{a}={v}" for a, v in sorted(m["aliases"].items())) or "-",
                _yes_no(m["ready"]),
                " ".join(f"{v}:{_yes_no(r)}" for v, r in m["versions_ready"].items()) or "-",
            ]
            for m in models
        ]
        print(format_table(["MODEL", "VERSIONS", "ALIASES", "READY", "VERSIONS READY"], mrows))
        for m in models:
            for version, reason in m.get("versions_reason", {}).items():
                print(f"  {m['name']} {version}: {reason}")
    elif not errors:
        print("no models (push one with `inferbus models push`)")
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if down:
        print(f"down: {', '.join(down)} (logs in {home / 'logs'})", file=sys.stderr)
    return 0 if healthy else 1
