"""Every INFERBUS_* variable the deploy files set is a real setting of the
service it is given to, its value passes that setting's validation, and no
required setting is left out."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from inferbus_common.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
INFERBUS_COMPOSE_SERVICES = (
    "gateway",
    "router",
    "batcher",
    "registry",
    "worker-gpu",
    "worker-cpu",
    "worker-llm",
    "edge",
)

Manifest = dict[str, Any]
# A value only known in the cluster (secretKeyRef, fieldRef): checked by name only.
UNKNOWN = object()


EDGE_PREFIX = "INFERBUS_EDGE_"


def edge_settings() -> set[str]:
    """The INFERBUS_EDGE_* variables the Go edge reads (its `env` and `envInt` calls)."""
    names: set[str] = set()
    for path in (REPO / "services" / "edge").glob("*.go"):
        names |= set(re.findall(r'\benv(?:Int)?\("([A-Z_]+)"', path.read_text()))
    return {EDGE_PREFIX + n for n in names}


def _check_edge_env(where: str, env: dict[str, object], names: list[str]) -> list[str]:
    known = edge_settings()
    problems = [f"{where}: {n} is not a setting of inferbus-edge" for n in names if n not in known]
    for name in names:
        value = env[name]
        if name.endswith("_PORT") and value is not UNKNOWN and not str(value).isdigit():
            problems.append(f"{where}: {name}={value!r} is not a port number")
    return problems


def check_env(
    where: str,
    env: dict[str, object],
    settings_by_prefix: dict[str, type[ServiceSettings]],
) -> list[str]:
    """Problems with the INFERBUS_* variables one process gets (empty = none).
    The Go edge's (INFERBUS_EDGE_*) are checked against the names it reads."""
    names = [n for n in env if n.startswith("INFERBUS_")]
    if not names:
        return [f"{where}: sets no INFERBUS_* variable"]
    if all(n.startswith(EDGE_PREFIX) for n in names):
        return _check_edge_env(where, env, names)
    prefixes = {p for p in settings_by_prefix if any(n.startswith(p) for n in names)}
    if len(prefixes) != 1:
        return [f"{where}: variables of several or no services: {sorted(names)}"]
    (prefix,) = prefixes
    cls = settings_by_prefix[prefix]
    problems = []
    values: dict[str, object] = {}
    for name in names:
        if not name.startswith(prefix):
            problems.append(f"{where}: {name} does not belong to {cls.__name__} ({prefix})")
            continue
        field = name.removeprefix(prefix).lower()
        if field not in cls.model_fields:
            problems.append(f"{where}: {name} is not a field of {cls.__name__}")
        elif env[name] is not UNKNOWN:
            values[field] = env[name]
    for field, info in cls.model_fields.items():
        if info.is_required() and field not in values and f"{prefix}{field.upper()}" not in env:
            problems.append(f"{where}: required setting {prefix}{field.upper()} is missing")
    if not problems:
        try:
            # Validate the literal values exactly as the service would at start-up.
            cls.model_validate(values)
        except ValidationError as exc:
            problems.append(f"{where}: {cls.__name__} rejects the values: {exc}")
    return problems


def test_checker_catches_unknown_and_invalid_settings(
    settings_by_prefix: dict[str, type[ServiceSettings]],
) -> None:
    problems = check_env(
        "broken",
        {"INFERBUS_GATEWAY_HTTP_PORTT": "8000", "INFERBUS_GATEWAY_GRPC_PORT": "not-a-port"},
        settings_by_prefix,
    )
    assert problems == ["broken: INFERBUS_GATEWAY_HTTP_PORTT is not a field of GatewaySettings"]
    problems = check_env("broken", {"INFERBUS_GATEWAY_GRPC_PORT": "99999"}, settings_by_prefix)
    assert len(problems) == 1 and "rejects the values" in problems[0]
    problems = check_env(
        "mixed",
        {"INFERBUS_GATEWAY_GRPC_PORT": "1", "INFERBUS_ROUTER_QUEUE_GROUP": "r"},
        settings_by_prefix,
    )
    assert len(problems) == 1 and "several" in problems[0]


@pytest.mark.parametrize("service", INFERBUS_COMPOSE_SERVICES)
def test_compose_environment_matches_the_settings(
    compose_model: dict[str, Any],
    settings_by_prefix: dict[str, type[ServiceSettings]],
    service: str,
) -> None:
    env = compose_model["services"][service]["environment"]
    assert check_env(f"compose:{service}", env, settings_by_prefix) == []


def test_checker_knows_the_edges_settings() -> None:
    assert {"INFERBUS_EDGE_NATS_URL", "INFERBUS_EDGE_UPSTREAM", "INFERBUS_EDGE_TLS_CERT_FILE"} <= (
        edge_settings()
    )
    problems = check_env(
        "edge", {"INFERBUS_EDGE_UPSTREEM": "gateway:8001", "INFERBUS_EDGE_GRPC_PORT": "x"}, {}
    )
    assert problems == [
        "edge: INFERBUS_EDGE_UPSTREEM is not a setting of inferbus-edge",
        "edge: INFERBUS_EDGE_GRPC_PORT='x' is not a port number",
    ]


def test_compose_infrastructure_gets_no_inferbus_settings(compose_model: dict[str, Any]) -> None:
    for name, service in compose_model["services"].items():
        if name in INFERBUS_COMPOSE_SERVICES:
            continue
        env = service.get("environment") or {}
        stray = [k for k in env if k.startswith("INFERBUS_") and k != "INFERBUS_S3_BUCKET"]
        assert stray == [], name


def _container_env(
    container: Manifest, config_maps: dict[str, dict[str, str]]
) -> dict[str, object]:
    """The environment a container gets: envFrom (with its prefix) then env."""
    env: dict[str, object] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        ref = source["configMapRef"]["name"]
        # Pool overlays are applied next to the core overlay that holds the ConfigMap.
        data = config_maps.get(ref, {})
        env.update({f"{prefix}{key}": value for key, value in data.items()})
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else UNKNOWN
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_environment_matches_the_settings(
    render: Callable[[Path], list[Manifest]],
    settings_by_prefix: dict[str, type[ServiceSettings]],
    overlay: str,
) -> None:
    docs = render(K8S / "overlays" / overlay)
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    if not config_maps:
        # A pool overlay alone: take the shared ConfigMap from the base it runs beside.
        base = render(K8S / "base")
        config_maps = {d["metadata"]["name"]: d["data"] for d in base if d["kind"] == "ConfigMap"}
    problems = []
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            env = _container_env(container, config_maps)
            where = f"{overlay}:{deployment['metadata']['name']}"
            problems += check_env(where, env, settings_by_prefix)
    assert problems == []
