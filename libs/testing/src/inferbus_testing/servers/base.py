"""What the test servers share: the child process, port choice, readiness polling
and the `_Server` base class."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
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
    pass


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
            body = json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return body if isinstance(body, dict) else None


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
