"""The Makefile's `images` target builds every service Dockerfile with the
VERSION and GIT_COMMIT build args, under the names compose and k8s expect."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _make_dry_run(*args: str) -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("GNU make is not installed")
    result = subprocess.run(
        [make, "--no-print-directory", "-n", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout


def _builds() -> dict[str, str]:
    """Image tag -> Dockerfile of every `docker build` that `make images` runs."""
    out = _make_dry_run("images", "VERSION=9.9.9", "GIT_COMMIT=abc1234", "REGISTRY=example/ib")
    commands = out.replace("\\\n", " ").splitlines()
    builds = {}
    for command in commands:
        if " build " not in command:
            continue
        assert "--build-arg VERSION=9.9.9" in command
        assert "--build-arg GIT_COMMIT=abc1234" in command
        assert command.rstrip().endswith(" ."), "the build context is the repository root"
        dockerfile = re.search(r"-f (\S+)", command)
        tag = re.search(r"-t (\S+)", command)
        assert dockerfile and tag, command
        builds[tag.group(1)] = dockerfile.group(1)
    return builds


def test_images_builds_every_service_dockerfile() -> None:
    builds = _builds()
    dockerfiles = {str(p.relative_to(REPO)) for p in (REPO / "services").glob("**/Dockerfile*")}
    assert set(builds.values()) == dockerfiles
    for image in ("gateway", "router", "batcher", "registry", "worker"):
        assert builds[f"example/ib/{image}:9.9.9"] == "services/Dockerfile"
    assert builds["example/ib/worker-gpu:9.9.9"] == "services/worker-gpu/Dockerfile.gpu"
    assert builds["example/ib/worker-llm:9.9.9"] == "services/worker-gpu/Dockerfile.llm"
    assert builds["example/ib/edge:9.9.9"] == "services/edge/Dockerfile"


def test_template_builds_pass_the_service_directory() -> None:
    out = _make_dry_run("images", "VERSION=9.9.9", "GIT_COMMIT=abc1234", "REGISTRY=example/ib")
    services = {}
    for command in out.replace("\\\n", " ").splitlines():
        if " build " in command:
            tag = re.search(r"-t example/ib/(\S+):9\.9\.9", command)
            service = re.search(r"--build-arg SERVICE=(\S+)", command)
            assert tag, command
            services[tag.group(1)] = service.group(1) if service else None
    assert services == {
        "gateway": "gateway",
        "router": "router",
        "batcher": "batcher",
        "registry": "registry",
        "worker": "worker-gpu",
        "worker-gpu": None,
        "worker-llm": None,
        "edge": None,
    }


def test_image_names_match_compose_and_kubernetes(compose_model: dict[str, Any]) -> None:
    names = {tag.removeprefix("example/ib/").removesuffix(":9.9.9") for tag in _builds()}
    for service in compose_model["services"].values():
        image = service.get("image", "")
        if "build" in service:
            assert image.split("/")[-1].split(":")[0] in names, image
    k8s_images = set()
    for path in (REPO / "deploy" / "k8s").rglob("*.yaml"):
        k8s_images |= set(re.findall(r"image: inferbus/([a-z-]+):", path.read_text()))
        k8s_images |= set(re.findall(r"newName: inferbus/([a-z-]+)", path.read_text()))
    assert k8s_images and k8s_images <= names


def test_down_uses_the_compose_file_and_env_file() -> None:
    out = _make_dry_run("down")
    assert "scripts/compose.sh -f compose/docker-compose.yml --env-file compose/.env" in out


def test_secure_adds_the_secure_override() -> None:
    plain = _make_dry_run("up", "-W", "compose/.env")
    assert "docker-compose.secure.yml" not in plain
    secure = _make_dry_run("up", "SECURE=1", "-W", "compose/.env")
    assert (
        "scripts/compose.sh -f compose/docker-compose.yml -f compose/docker-compose.secure.yml"
        " --env-file compose/.env up -d" in secure
    )
    assert "compose/secure-init.sh" in _make_dry_run("secrets")
