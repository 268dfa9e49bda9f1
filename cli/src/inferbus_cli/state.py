"""The state of a local stack: where it lives (the home) and `state.json`.

`inferbus up` writes `<home>/state.json` with every process it started (pid,
ports, log file) and the endpoints to call; `down`, `status`, `models` and
`infer` read it back. A pid alone is not an identity (pids are reused), so each
record also keeps the process start time from ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
STATE_VERSION = 1


def resolve_home(home: str | Path | None) -> Path:
    """The stack's home: the given path, else ``$INFERBUS_HOME``, else ``./.inferbus``."""
    if home:
        return Path(home).expanduser().absolute()
    env = os.environ.get("INFERBUS_HOME")
    if env:
        return Path(env).expanduser().absolute()
    return (Path.cwd() / ".inferbus").absolute()


@dataclass(slots=True)
class ProcessRecord:
    """One process of the stack as recorded in `state.json`.

    Attributes:
        name: ``nats``, ``redis``, ``registry``, ``router``, ``batcher``,
            ``worker-1`` ..., ``gateway``.
        pid: process id (also its process group: each runs in its own session).
        start_ticks: start time in clock ticks since boot (``/proc/<pid>/stat``
            field 22); 0 when unknown.
        argv: the command line it was started with.
        log: file its stdout and stderr go to.
        ports: ports it bound, by role (``grpc``, ``http``, ``metrics``, ...).
        exit_code: set once the process is known to have exited.
        restarts: times the supervisor has started it again after a crash.
        last_exit: how its previous process ended (``killed by SIGKILL`` ...).
        restarting_at: when the supervisor starts it again (unix seconds), after a
            crash; 0 when no restart is pending.
    """

    name: str
    pid: int
    start_ticks: int = 0
    argv: list[str] = field(default_factory=list)
    log: str = ""
    ports: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    restarts: int = 0
    last_exit: str = ""
    restarting_at: float = 0.0


@dataclass(slots=True)
class StackState:
    """Everything `up` recorded about a running stack.

    Attributes:
        home: the stack's home directory.
        started_unix: wall-clock start time (seconds since the epoch).
        detached: started with ``-d`` (the supervisor runs in the background).
        supervisor_pid: pid of the process that supervises the stack: the
            foreground ``inferbus up``, or the background supervisor of ``up -d``.
        processes: in start order; they are stopped in reverse.
        endpoints: addresses to call (``gateway_grpc``, ``gateway_http``,
            ``registry``, ``nats``, ``redis`` ...).
        stack_id: this stack's id, also given to its registry and gateways; a
            command reaching them through this file expects it
            (`inferbus_common.stackid`). Empty in files of older versions.
    """

    home: str
    started_unix: float
    detached: bool
    supervisor_pid: int = 0
    processes: list[ProcessRecord] = field(default_factory=list)
    endpoints: dict[str, str] = field(default_factory=dict)
    stack_id: str = ""

    def to_json(self) -> str:
        """Serialise as indented JSON (with a format version)."""
        return json.dumps({"version": STATE_VERSION, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> StackState:
        """Parse what `to_json` wrote.

        Raises:
            ValueError: if the text is not a state file this version understands.
        """
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            raise ValueError(f"not an inferbus state file (version {STATE_VERSION})")
        procs = [ProcessRecord(**p) for p in raw.get("processes", [])]
        return cls(
            home=raw["home"],
            started_unix=float(raw["started_unix"]),
            detached=bool(raw["detached"]),
            supervisor_pid=int(raw.get("supervisor_pid", 0)),
            processes=procs,
            endpoints=dict(raw.get("endpoints", {})),
            stack_id=str(raw.get("stack_id", "")),
        )


def state_path(home: Path) -> Path:
    """Path of the state file under `home`."""
    return home / STATE_FILE


def save_state(home: Path, state: StackState) -> Path:
    """Atomically write `state` to ``<home>/state.json``; returns the path."""
    path = state_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(state.to_json())
    tmp.replace(path)
    return path


def load_state(home: Path) -> StackState | None:
    """The stack state under `home`, or None when there is none.

    Raises:
        ValueError: if the file exists but cannot be read as a state file.
    """
    path = state_path(home)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return StackState.from_json(text)
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable state file: {exc}") from exc


def remove_state(home: Path) -> None:
    """Delete the state file (no error when it is already gone)."""
    with contextlib.suppress(FileNotFoundError):
        state_path(home).unlink()


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) of a process from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces
    # or parentheses, so split after the last ')'.
    rest = text[text.rfind(")") + 2 :].split()
    return rest[0], int(rest[19])


def process_start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (0 when unknown)."""
    stat = _proc_stat(pid)
    return stat[1] if stat else 0


def is_alive(pid: int, start_ticks: int = 0) -> bool:
    """Whether the process still runs and is the one recorded.

    A zombie (exited, not yet reaped) counts as dead; when `start_ticks` is
    known, a different process that reused the pid counts as dead too.
    """
    if pid <= 0:
        return False
    if Path("/proc").is_dir():
        stat = _proc_stat(pid)
        if stat is None:
            return False
        state, ticks = stat
        if state in ("Z", "X"):
            return False
        return not (start_ticks and ticks != start_ticks)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_process(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to the process and, when it leads its own group, to the group.

    Services run in their own session, so signalling the group also reaches
    any helper process they started.
    """
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def last_log_lines(path: str | Path, count: int = 10) -> list[str]:
    """The last `count` lines of a log file (empty when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return [line for line in lines if line.strip()][-count:]


def default_registry_address(home: Path) -> str:
    """Registry gRPC address: from the running stack's state, else 127.0.0.1:8070."""
    return _endpoint(home, "registry", "127.0.0.1:8070")


def default_gateway_address(home: Path) -> str:
    """Gateway KServe gRPC address: from the running stack's state, else 127.0.0.1:8001."""
    return _endpoint(home, "gateway_grpc", "127.0.0.1:8001")


STACK_ID_ENV = "INFERBUS_STACK_ID"
"""Environment variable naming the stack every call must reach (a compose stack's:
compose/push-example.sh sets it); it wins over the state file."""


def expected_stack(home: Path, address: str) -> str:
    """The stack id a call to `address` must reach: ``$INFERBUS_STACK_ID`` when set,
    else the id of the stack under `home` when `address` is one of its endpoints,
    else "" (no check)."""
    explicit = os.environ.get(STACK_ID_ENV, "").strip()
    if explicit:
        return explicit
    try:
        state = load_state(home)
    except ValueError:
        return ""
    if state is None or address not in state.endpoints.values():
        return ""
    return state.stack_id


def _endpoint(home: Path, key: str, fallback: str) -> str:
    try:
        state = load_state(home)
    except ValueError:
        return fallback
    if state is None:
        return fallback
    return state.endpoints.get(key, fallback)
