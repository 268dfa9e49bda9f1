"""compose/docker-compose.yml, checked offline with Docker Compose v2 (`config`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"

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
    "nats",
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
    assert env["INFERBUS_REGISTRY_S3_SECRET_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    bucket_job = compose_model["services"]["minio-init"]
    assert bucket_job["environment"]["INFERBUS_S3_BUCKET"] == env["INFERBUS_REGISTRY_S3_BUCKET"]
    assert "mc mb" in " ".join(bucket_job["command"])
    published = {p["target"] for p in registry["ports"]}
    assert 8070 in published, "push-example.sh pushes through the registry's gRPC port"


def test_nats_runs_jetstream_with_monitoring(compose_model: dict[str, Any]) -> None:
    nats = compose_model["services"]["nats"]
    assert "-js" in nats["command"]
    assert nats["command"][nats["command"].index("-m") + 1] == "8222"
    assert "8222" in " ".join(nats["healthcheck"]["test"])


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
    assert "127.0.0.1:8070" in text
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
