"""``inferbus down``: stop every process recorded in `state.json`, in reverse order."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from inferbus_cli.state import (
    is_alive,
    load_state,
    remove_state,
    resolve_home,
    signal_process,
)
from inferbus_cli.supervisor import POLL_S, stop_pid


def _say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    """Stop the stack under ``--home``; exit 0 also when nothing was running."""
    home = resolve_home(args.home)
    try:
        state = load_state(home)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if state is None:
        _say(f"nothing is running from {home} (no state.json)")
        return 0
    timeout = args.timeout
    # The supervisor (a foreground `inferbus up`, or the background one of
    # `up -d`) stops its children in order when told to; let it, then sweep
    # whatever is left.
    if state.supervisor_pid and is_alive(state.supervisor_pid):
        where = "background supervisor" if state.detached else "foreground `inferbus up`"
        _say(f"  asking the {where} (pid {state.supervisor_pid}) to stop")
        signal_process(state.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout * max(1, len(state.processes))
        while is_alive(state.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    left: list[str] = []
    for proc in reversed(state.processes):
        if not is_alive(proc.pid, proc.start_ticks):
            continue
        _say(f"  stopping {proc.name} (pid {proc.pid})")
        stop_pid(proc.name, proc.pid, proc.start_ticks, timeout, _say)
        if is_alive(proc.pid, proc.start_ticks):
            left.append(f"{proc.name} (pid {proc.pid})")
    if left:
        print(f"error: still running after SIGKILL: {', '.join(left)}", file=sys.stderr)
        return 1
    for proc in state.processes:
        # Stale ports files would otherwise look like a serving process.
        (home / "run" / f"{proc.name}.json").unlink(missing_ok=True)
    remove_state(home)
    _say(f"stopped the stack in {home}")
    return 0
