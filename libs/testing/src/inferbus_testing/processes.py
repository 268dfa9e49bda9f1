"""Run an inferbus service as a real process, the way production does.

`ServiceProcess` runs ``python -m <module>`` with the given environment (merged
over ``os.environ``), points ``<PREFIX>PORTS_FILE`` at a temp file and waits
for the service to write its bound ports there
(`inferbus_common.ops.write_ports_file`). Output goes to a log file; when the
service exits early or is not up in time, the error carries the log tail::

    from inferbus_testing.processes import ServiceProcess

    async def test_router(nats_server, tmp_path):
        env = {"INFERBUS_ROUTER_NATS_URL": nats_server.url}
        async with ServiceProcess("inferbus_router", env=env, log_dir=tmp_path) as router:
            await router.await_ready()           # GET /readyz on its metrics port == 200
            ...
            assert router.ports["metrics"] > 0
        # leaving the block: SIGTERM, then SIGKILL if it does not exit in time

The env prefix defaults to the module's top package upper-cased
(``inferbus_router`` → ``INFERBUS_ROUTER_``); pass ``env_prefix`` otherwise.
Sync (`start`, `wait_ready`, `terminate`) and async (`astart`, `await_ready`,
`aterminate`) variants exist; the async ones poll with short
``asyncio.sleep`` steps so the test's event loop keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from inferbus_testing._children import die_with_parent

__all__ = ["ServiceError", "ServiceProcess"]

_POLL_S = 0.02


class ServiceError(RuntimeError):
    """A service process failed to start, exited early, or never became ready."""


class ServiceProcess:
    """A service started as ``[sys.executable, "-m", module, *args]``.

    Args:
        module: module to run, e.g. ``"inferbus_gateway"``.
        env: environment variables for the service, merged over ``os.environ``.
        env_prefix: settings prefix; default from the module name
            (``"inferbus_gateway"`` → ``"INFERBUS_GATEWAY_"``).
        args: extra command-line arguments.
        log_dir: where the log and ports file go; a temp dir when None.
        name: label for the log file and errors; defaults to the module name.
        python: interpreter to run the module with (default: this one), e.g. the
            separate vLLM environment's for the LLM worker.
        nice: added to the process' niceness (its children inherit it), for a
            service that would otherwise take the CPU the others need.
        command: run this instead of ``python -m module`` (a compiled service such
            as ``inferbus-edge``; `module` then only names it and its env prefix).
    """

    def __init__(
        self,
        module: str,
        *,
        env: Mapping[str, str] | None = None,
        env_prefix: str | None = None,
        args: Sequence[str] = (),
        log_dir: Path | None = None,
        name: str | None = None,
        python: str | None = None,
        nice: int = 0,
        command: Sequence[str] | None = None,
    ) -> None:
        self.module = module
        self.command = tuple(command) if command is not None else None
        self.nice = nice
        self.python = python or sys.executable
        self.name = name or module
        self.env_prefix = env_prefix or module.split(".", 1)[0].upper() + "_"
        self.args = tuple(args)
        self._extra_env = dict(env or {})
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"ib-{self.name}-")
            log_dir = Path(self._tmp.name)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.name}.log"
        self.ports_file = log_dir / f"{self.name}.ports.json"
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports: dict[str, int] = {}

    # ----------------------------------------------------------------- state

    @property
    def pid(self) -> int | None:
        """Process id, or None before `start`."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit code once the process has exited (negative: killed by that signal)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def ports(self) -> dict[str, int]:
        """Ports the service reported (``{"metrics": 41234, ...}``; without ``pid``).

        Raises:
            ServiceError: before the ports file was read.
        """
        if not self._ports:
            raise ServiceError(f"{self.name}: ports not known yet; call start() first")
        return dict(self._ports)

    def readyz_url(self, port_name: str = "metrics") -> str:
        """URL of the /readyz endpoint on the named port."""
        return f"http://127.0.0.1:{self.ports[port_name]}/readyz"

    def log_tail(self, lines: int = 60) -> str:
        """Last lines of the service's stdout/stderr."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def _error(self, message: str) -> ServiceError:
        return ServiceError(
            f"{self.name}: {message}\n--- log tail ({self.log_path}) ---\n{self.log_tail()}"
        )

    # ----------------------------------------------------------------- start

    def _spawn(self) -> None:
        if self.running:
            raise ServiceError(f"{self.name}: already running")
        self.ports_file.unlink(missing_ok=True)
        self._ports = {}
        env = {
            **os.environ,
            # Unbuffered, so the log tail in an error shows the latest lines.
            "PYTHONUNBUFFERED": "1",
            # A free port unless the test names one (the ports file reports it): a
            # fixed default port is taken by anything else on the machine.
            f"{self.env_prefix}METRICS_PORT": "0",
            **self._extra_env,
            f"{self.env_prefix}PORTS_FILE": str(self.ports_file),
        }
        with self.log_path.open("ab") as log:
            # Own session: signals reach the service and its children, never pytest.
            self._proc = subprocess.Popen(
                [*(self.command or (self.python, "-m", self.module)), *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self._preexec,
            )

    def _preexec(self) -> None:
        die_with_parent()
        if self.nice:
            os.nice(self.nice)

    def _check_started(self) -> bool:
        """True once the ports file of *this* process is there; raises if it exited."""
        assert self._proc is not None
        if self.ports_file.exists():
            data = json.loads(self.ports_file.read_text())
            # A file left by an earlier run of the same service is not ours.
            if data.get("pid") == self._proc.pid:
                self._ports = {k: int(v) for k, v in data.items() if k != "pid"}
                return True
        if self._proc.poll() is not None:
            raise self._error(f"exited with code {self._proc.returncode} during start-up")
        return False

    def _start_timeout(self, timeout: float) -> ServiceError:
        self.kill()
        return self._error(f"no ports file {self.ports_file} after {timeout:.1f}s")

    def start(self, timeout: float = 20.0) -> Self:
        """Start the process and block until it wrote its ports file.

        Raises:
            ServiceError: when it exits first or `timeout` passes (it is killed then).
        """
        self._spawn()
        deadline = time.monotonic() + timeout
        while not self._check_started():
            if time.monotonic() >= deadline:
                raise self._start_timeout(timeout)
            time.sleep(_POLL_S)
        return self

    async def astart(self, timeout: float = 20.0) -> Self:
        """`start` without blocking the event loop."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while not self._check_started():
            if time.monotonic() >= deadline:
                raise self._start_timeout(timeout)
            await asyncio.sleep(_POLL_S)
        return self

    # ----------------------------------------------------------------- ready

    def _raise_if_exited(self) -> None:
        if not self.running:
            raise self._error(f"exited with code {self.returncode} before being ready")

    def wait_ready(self, url: str | None = None, timeout: float = 20.0) -> None:
        """Poll an HTTP endpoint (default: /readyz on the metrics port) until it answers 200.

        Raises:
            ServiceError: when the process exits or `timeout` passes.
        """
        url = url or self.readyz_url()
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while True:
                self._raise_if_exited()
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url).status_code == 200:
                        return
                if time.monotonic() >= deadline:
                    raise self._error(f"{url} not 200 after {timeout:.1f}s")
                time.sleep(_POLL_S)

    async def await_ready(self, url: str | None = None, timeout: float = 20.0) -> None:
        """`wait_ready` without blocking the event loop."""
        url = url or self.readyz_url()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                self._raise_if_exited()
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() >= deadline:
                    raise self._error(f"{url} not 200 after {timeout:.1f}s")
                await asyncio.sleep(_POLL_S)

    # ------------------------------------------------------------------ stop

    def send_signal(self, signum: int) -> None:
        """Send a signal to the service's process group (no-op once it exited)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signum)

    def terminate(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout` seconds, then SIGKILL; returns the exit code.

        The exit code is negative when a signal killed it (``-9``: it had to be killed).
        """
        if self._proc is None:
            return None
        self.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    async def aterminate(self, timeout: float = 10.0) -> int | None:
        """`terminate` without blocking the event loop."""
        if self._proc is None:
            return None
        self.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self._proc.poll() is None:
            if time.monotonic() >= deadline:
                return self.kill()
            await asyncio.sleep(_POLL_S)
        return self._proc.returncode

    def kill(self) -> int | None:
        """SIGKILL the service (a crash); returns the exit code."""
        if self._proc is None:
            return None
        self.send_signal(signal.SIGKILL)
        return self._proc.wait()

    def cleanup(self) -> None:
        """Kill the process if still alive and remove the temp dir (when it made one)."""
        try:
            self.kill()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    # ------------------------------------------------------- context managers

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.terminate()
        finally:
            self.cleanup()

    async def __aenter__(self) -> Self:
        try:
            return await self.astart()
        except BaseException:
            self.cleanup()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aterminate()
        finally:
            self.cleanup()
