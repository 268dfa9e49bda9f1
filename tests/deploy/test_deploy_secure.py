"""The secured deployments: compose/docker-compose.secure.yml with the secrets
compose/secure-init.sh writes, and the Kubernetes component `secure`.

Offline like the other deploy checks (Compose `config`, `kubectl kustomize`),
plus the two pieces the override hands to third-party servers, run for real: the
NATS configuration with the generated users, and redis-server with the
generated `requirepass` file.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pytest
import redis
import yaml

from inferbus_common.security import ROLES
from inferbus_common.settings import ServiceSettings
from inferbus_testing.servers import NatsServer, RedisServer

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
SECURE_COMPOSE_FILE = REPO / "compose" / "docker-compose.secure.yml"
ENV_EXAMPLE = REPO / "compose" / ".env.example"
K8S = REPO / "deploy" / "k8s"
SECURE_INIT = REPO / "compose" / "secure-init.sh"
NATS_CONF = REPO / "compose" / "nats" / "inferbus-secure.conf"

Manifest = dict[str, Any]
Render = Callable[[Path], list[Manifest]]


def _sibling(name: str) -> Any:
    """A helper module of this folder (tests run with --import-mode=importlib: no package)."""
    spec = importlib.util.spec_from_file_location(
        f"_deploy_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_env = _sibling("test_deploy_settings").check_env
validate_manifests = _sibling("test_deploy_k8s").validate_manifests

# compose service -> NATS role (inferbus_common.security.ROLES).
ROLE_OF_SERVICE = {
    "gateway": "gateway",
    "router": "router",
    "batcher": "batcher",
    "registry": "registry",
    "worker-gpu": "worker",
    "worker-cpu": "worker",
    "worker-llm": "llm",
}


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What compose/secure-init.sh writes (NATS users, Redis, tokens, TLS)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: secure-init.sh makes the TLS certificate with it")
    out = tmp_path_factory.mktemp("secure") / "secrets"
    subprocess.run(
        [str(SECURE_INIT), str(out)], cwd=REPO, check=True, timeout=120, capture_output=True
    )
    return out


@pytest.fixture(scope="module")
def secure_model(compose_cli: Any, secrets_dir: Path) -> dict[str, Any]:
    """The secured compose project as Compose resolves it (all profiles)."""
    env_file = secrets_dir.parent / "compose.env"
    env_file.write_text(ENV_EXAMPLE.read_text() + f"\nINFERBUS_SECRETS_DIR={secrets_dir}\n")
    result = compose_cli.run(
        "-f", str(COMPOSE_FILE), "-f", str(SECURE_COMPOSE_FILE),
        "--project-directory", str(COMPOSE_FILE.parent), "--env-file", str(env_file),
        "--profile", "*", "config", "--format", "json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _secret_values(secrets_dir: Path) -> dict[str, str]:
    """Every secret value secure-init.sh wrote (passwords, tokens, TLS key)."""
    values = {}
    for path in secrets_dir.iterdir():
        if path.suffix in (".crt", ".conf"):
            continue  # a certificate is public; the .conf files repeat the passwords
        values[path.name] = path.read_text().strip()
    return values


# ---------------------------------------------------------------- secure-init.sh


def test_secure_init_writes_every_secret_privately_and_keeps_them(secrets_dir: Path) -> None:
    names = {p.name for p in secrets_dir.iterdir()}
    roles = set(ROLE_OF_SERVICE.values()) | {"admin"}
    assert {f"{r}.nats-password" for r in roles} <= names
    assert {
        "nats-auth.conf",
        "redis.password",
        "redis.conf",
        "registry-admin.token",
        "registry-reader.token",
        "gateway-tls.crt",
        "gateway-tls.key",
    } <= names
    # The folder keeps other users of the host out.
    assert secrets_dir.stat().st_mode & 0o777 == 0o700
    values = _secret_values(secrets_dir)
    assert all(len(v) >= 24 for k, v in values.items() if not k.endswith(".key")), values.keys()
    assert len(set(values.values())) == len(values), "every secret is different"
    # A second run changes nothing (no silent rotation).
    subprocess.run(
        [str(SECURE_INIT), str(secrets_dir)], cwd=REPO, check=True, timeout=60, capture_output=True
    )
    assert _secret_values(secrets_dir) == values


def test_generated_nats_config_authenticates_each_service(
    secrets_dir: Path, tmp_path: Path
) -> None:
    """nats-server with compose/nats/inferbus-secure.conf and the generated users."""
    conf_dir = tmp_path / "etc-nats"
    conf_dir.mkdir()
    # The same layout as in the container: the auth file beside the configuration.
    # Only the JetStream store moves from the container's volume to a temp dir.
    conf = NATS_CONF.read_text()
    assert 'store_dir: "/data"' in conf
    store = json.dumps(str(tmp_path / "jetstream"))
    (conf_dir / "inferbus.conf").write_text(conf.replace('"/data"', store))
    shutil.copy(secrets_dir / "nats-auth.conf", conf_dir / "nats-auth.conf")
    password = (secrets_dir / "registry.nats-password").read_text().strip()

    async def jetstream_streams(user: str, password: str) -> int:
        nc = await nats.connect(
            server.url, user=user, password=password, allow_reconnect=False,
            connect_timeout=2, inbox_prefix=f"_INBOX_{user}".encode(),
        )  # fmt: skip
        try:
            # JetStream, from the configuration file, answers the service user.
            return (await nc.jetstream().account_info()).streams
        finally:
            await nc.close()

    def connect_raw(**auth: str) -> str:
        # nats-py leaks the socket of a refused connection: speak the protocol by hand.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.recv(4096)  # INFO
            connect = {"verbose": False, "pedantic": False, "protocol": 1, **auth}
            sock.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
            return sock.recv(4096).decode(errors="replace")

    # jetstream=False: the configuration file itself turns JetStream on.
    extra = ["-c", str(conf_dir / "inferbus.conf")]
    with NatsServer(tmp_path / "nats", jetstream=False, extra_args=extra) as server:
        assert asyncio.run(jetstream_streams("registry", password)) == 0
        assert "PONG" in connect_raw(user="registry", **{"pass": password})
        assert "Authorization Violation" in connect_raw()
        assert "Authorization Violation" in connect_raw(user="registry", **{"pass": "wrong"})


def test_generated_redis_config_requires_the_password(secrets_dir: Path, tmp_path: Path) -> None:
    """redis-server --include redis.conf (as in the override) wants redis.password."""
    password = (secrets_dir / "redis.password").read_text().strip()
    extra = ["--include", str(secrets_dir / "redis.conf")]
    with RedisServer(tmp_path / "redis", extra_args=extra) as server:
        with redis.Redis(port=server.port, socket_timeout=2) as anonymous:
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
        with redis.Redis(port=server.port, password=password, socket_timeout=2) as client:
            assert client.ping()


# ---------------------------------------------------------------- compose override


def test_secure_override_renders_and_every_setting_is_real(
    secure_model: dict[str, Any], settings_by_prefix: dict[str, type[ServiceSettings]]
) -> None:
    for service, role in ROLE_OF_SERVICE.items():
        env = secure_model["services"][service]["environment"]
        assert check_env(f"secure:{service}", env, settings_by_prefix) == []
        prefix = next(k for k in env if k.endswith("_NATS_URL")).removesuffix("NATS_URL")
        assert env[f"{prefix}NATS_USER"] == role, service
        assert env[f"{prefix}NATS_PASSWORD_FILE"] == f"/run/secrets/{role}.nats-password"


def test_secure_override_mounts_every_file_setting_from_a_generated_secret(
    secure_model: dict[str, Any], secrets_dir: Path
) -> None:
    declared = secure_model["secrets"]
    for name, secret in declared.items():
        if "environment" in secret:
            # docker-compose.yml's own: a value of compose/.env (the S3 key).
            assert name == "s3-secret-key" and secret["environment"] == "MINIO_ROOT_PASSWORD"
            continue
        # Each secret of the override is a file secure-init.sh wrote.
        assert Path(secret["file"]).parent == secrets_dir, name
        assert Path(secret["file"]).is_file(), name
    for service in ROLE_OF_SERVICE:
        spec = secure_model["services"][service]
        mounted = {s["target"]: s["source"] for s in spec.get("secrets", [])}
        files = {k: v for k, v in spec["environment"].items() if k.endswith("_FILE")}
        assert files, service
        for key, path in files.items():
            assert path in mounted, (service, key, path)
        # Nothing mounted that the service does not read.
        assert set(mounted) == set(files.values()), service


def test_secure_override_puts_no_secret_in_any_environment_or_command(
    secure_model: dict[str, Any], secrets_dir: Path
) -> None:
    values = _secret_values(secrets_dir)
    rendered = json.dumps(
        {
            name: {k: spec.get(k) for k in ("environment", "command", "healthcheck", "entrypoint")}
            for name, spec in secure_model["services"].items()
        }
    )
    leaked = [name for name, value in values.items() if value in rendered]
    assert leaked == []


def test_secure_override_locks_nats_redis_registry_and_gateway(
    secure_model: dict[str, Any],
) -> None:
    services = secure_model["services"]
    for node in ("nats-1", "nats-2", "nats-3"):
        nats_service = services[node]
        command = nats_service["command"]
        assert command[:2] == ["-c", "/etc/nats/inferbus.conf"], node
        # Still a cluster node: its own name, every node's route.
        assert command[command.index("--server_name") + 1] == f"inferbus-{node}"
        assert command[command.index("--routes") + 1].count("nats://") == 3
        volumes = nats_service["volumes"]
        targets = {v["target"]: v["source"] for v in volumes if v["type"] == "bind"}
        assert Path(targets["/etc/nats/inferbus.conf"]) == NATS_CONF
        # The node's JetStream store stays on its volume.
        assert any(v["type"] == "volume" and v["target"] == "/data" for v in volumes), node
        (auth,) = nats_service["secrets"]
        # nats-server resolves `include nats-auth.conf` beside the configuration.
        assert auth["target"] == "/etc/nats/nats-auth.conf"
    assert "include nats-auth.conf" in NATS_CONF.read_text()

    redis_service = services["redis"]
    assert redis_service["command"][:3] == ["redis-server", "--include", "/run/secrets/redis.conf"]
    assert not redis_service.get("environment"), "the password comes from the secret only"
    assert "/run/secrets/redis.password" in " ".join(redis_service["healthcheck"]["test"])

    gateway = services["gateway"]["environment"]
    assert gateway["INFERBUS_GATEWAY_REDIS_URL"] == "redis://redis:6379/0"
    assert gateway["INFERBUS_GATEWAY_REGISTRY_TOKEN_FILE"].endswith("registry-admin.token")
    assert "https://127.0.0.1:8000" in " ".join(services["gateway"]["healthcheck"]["test"])
    registry = services["registry"]["environment"]
    assert registry["INFERBUS_REGISTRY_ADMIN_TOKEN_FILE"].endswith("registry-admin.token")
    assert registry["INFERBUS_REGISTRY_READER_TOKEN_FILE"].endswith("registry-reader.token")
    for worker in ("worker-gpu", "worker-cpu"):
        env = services[worker]["environment"]
        assert env["INFERBUS_WORKER_REGISTRY_TOKEN_FILE"].endswith("registry-reader.token")
        assert not any("admin" in s["source"] for s in services[worker]["secrets"])


# ---------------------------------------------------------------- Kubernetes component


def _mounted_secret_files(deployment: Manifest, container: Manifest) -> dict[str, str]:
    """Path of every file a Secret volume puts in the container -> the Secret's name."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        keys = [i["path"] for i in secret["items"]] if "items" in secret else None
        for key in keys or ["*"]:
            files[f"{mount['mountPath']}/{key}"] = secret["secretName"]
    return files


def _check_secured(docs: list[Manifest]) -> list[str]:
    problems = []
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        name = deployment["metadata"]["name"]
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            users = [k for k in env if k.endswith("_NATS_USER")]
            if len(users) != 1:
                problems.append(f"{name}: NATS user settings {users}")
                continue
            mounted = _mounted_secret_files(deployment, container)
            for key, item in env.items():
                if not key.endswith("_FILE"):
                    continue
                path = item.get("value", "")
                folder = path.rsplit("/", 1)[0]
                if path not in mounted and f"{folder}/*" not in mounted:
                    problems.append(f"{name}: {key}={path} is not a mounted Secret file")
            # The service runs as uid 10001: it reads the files through the pod's fsGroup.
            pod = deployment["spec"]["template"]["spec"]
            for volume in pod["volumes"]:
                mode = volume.get("secret", {}).get("defaultMode", 0o644)
                if "secret" in volume and not (
                    pod["securityContext"].get("fsGroup") and mode & 0o040
                ):
                    problems.append(f"{name}: Secret volume {volume['name']} is not group-readable")
            for item in env.values():
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                # The registry's S3 keys have no file setting yet (known limit).
                if ref and ref["name"] != "inferbus-s3":
                    problems.append(f"{name}: {item['name']} comes from a secret in the env")
    return problems


def test_secure_overlay_puts_every_service_on_its_nats_user_with_file_secrets(
    render: Render, settings_by_prefix: dict[str, type[ServiceSettings]]
) -> None:
    docs = render(K8S / "overlays" / "secure")
    assert _check_secured(docs) == []
    roles = {}
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        roles[deployment["metadata"]["name"]] = next(
            v for k, v in env.items() if k.endswith("_NATS_USER")
        )
        if deployment["metadata"]["name"] == "gateway":
            assert env["INFERBUS_GATEWAY_TLS_CERT_FILE"] == "/etc/inferbus/tls/tls.crt"
            assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
            assert "@" not in env["INFERBUS_GATEWAY_REDIS_URL"], "no password in the URL"
    assert roles == {
        "gateway": "gateway",
        "edge": "edge",
        "router": "router",
        "batcher": "batcher",
        "registry": "registry",
    }
    # The secure overlay ships no Secret: they come from the operator's store.
    assert [d for d in docs if d["kind"] == "Secret"] == []


def _secret_file_sources(deployment: Manifest, container: Manifest) -> dict[str, tuple[str, str]]:
    """Path of every file a Secret volume puts in the container -> (Secret, key)."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    sources = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        for item in secret.get("items", []):
            sources[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return sources


def _resolve(deployment: Manifest, container: Manifest, path: str) -> tuple[str, str] | None:
    """(Secret, key) a file setting reads; a Secret mounted whole gives each key a file."""
    sources = _secret_file_sources(deployment, container)
    if path in sources:
        return sources[path]
    folder, name = path.rsplit("/", 1)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is not None and "items" not in secret and mount["mountPath"] == folder:
            return (secret["secretName"], name)
    return None


def edge_secure_problems(docs: list[Manifest]) -> list[str]:
    """The edge in the secure overlay: NATS user `edge` with its own password
    from Secret inferbus-nats, TLS with the gateway's pair, trusting the gateway."""
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    edge, gateway = deployments["edge"], deployments["gateway"]
    (container,) = edge["spec"]["template"]["spec"]["containers"]
    (gateway_container,) = gateway["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    gateway_env = {e["name"]: e.get("value") for e in gateway_container["env"]}
    problems = []
    if env.get("INFERBUS_EDGE_NATS_USER") != "edge":
        problems.append(f"NATS user {env.get('INFERBUS_EDGE_NATS_USER')!r}")
    password = _resolve(edge, container, env.get("INFERBUS_EDGE_NATS_PASSWORD_FILE") or "")
    # The Secret holds one key per role (docs/operations.md, from <role>.nats-password).
    gateway_password = _resolve(
        gateway, gateway_container, gateway_env["INFERBUS_GATEWAY_NATS_PASSWORD_FILE"]
    )
    assert gateway_password == ("inferbus-nats", "gateway")
    if password != (gateway_password[0], "edge"):
        problems.append(f"NATS password file from {password}, expected (inferbus-nats, edge)")
    gateway_tls = {
        suffix: _resolve(gateway, gateway_container, gateway_env[f"INFERBUS_GATEWAY_{suffix}"])
        for suffix in ("TLS_CERT_FILE", "TLS_KEY_FILE")
    }
    assert gateway_tls["TLS_CERT_FILE"] == ("inferbus-gateway-tls", "tls.crt")
    expected = {**gateway_tls, "UPSTREAM_CA_FILE": gateway_tls["TLS_CERT_FILE"]}
    for suffix, source in expected.items():
        got = _resolve(edge, container, env.get(f"INFERBUS_EDGE_{suffix}") or "")
        if got != source:
            problems.append(f"INFERBUS_EDGE_{suffix} reads {got}, expected {source}")
    return problems


def test_secure_overlay_gives_the_edge_its_nats_user_and_the_gateways_tls(render: Render) -> None:
    docs = render(K8S / "overlays" / "secure")
    assert edge_secure_problems(docs) == []
    assert "edge" in ROLES
    # Every service reads the password of its own NATS user, and only that one.
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        user = next(v for k, v in env.items() if k.endswith("_NATS_USER"))
        path = next(v for k, v in env.items() if k.endswith("_NATS_PASSWORD_FILE"))
        assert user in ROLES
        assert _resolve(deployment, container, path) == ("inferbus-nats", user)


def test_operations_doc_creates_every_nats_key_the_component_mounts(render: Render) -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    (roles,) = re.findall(
        r"for r in ([a-z ]+); do echo --from-file=\$r=\$S/\$r\.nats-password", text
    )
    keys = {
        item["key"]
        for d in render(K8S / "overlays" / "secure")
        if d["kind"] == "Deployment"
        for v in d["spec"]["template"]["spec"]["volumes"]
        if v.get("secret", {}).get("secretName") == "inferbus-nats"
        for item in v["secret"]["items"]
    }
    assert "edge" in keys
    assert keys <= set(roles.split())


def test_edge_secure_checker_catches_a_wrong_password_and_a_missing_tls_mount(
    render: Render,
) -> None:
    docs = json.loads(json.dumps(render(K8S / "overlays" / "secure")))
    edge = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "edge")
    pod = edge["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if volume["name"] == "nats-password":
            volume["secret"]["items"][0]["key"] = "gateway"
    container = pod["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "tls"]
    problems = edge_secure_problems(docs)
    assert any(
        p.startswith("NATS password file from ('inferbus-nats', 'gateway')") for p in problems
    )
    for suffix in ("TLS_CERT_FILE", "TLS_KEY_FILE", "UPSTREAM_CA_FILE"):
        assert any(p.startswith(f"INFERBUS_EDGE_{suffix} reads None") for p in problems), problems


def test_checker_catches_an_env_secret_and_an_unmounted_file(render: Render) -> None:
    docs = json.loads(json.dumps(render(K8S / "overlays" / "secure")))
    gateway = next(
        d for d in docs if d["metadata"]["name"] == "gateway" and d["kind"] == "Deployment"
    )
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container["env"].append(
        {
            "name": "INFERBUS_GATEWAY_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}},
        }
    )
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "tls"]
    problems = _check_secured(docs)
    assert any("REDIS_PASSWORD comes from a secret" in p for p in problems), problems
    assert any("TLS_CERT_FILE" in p for p in problems), problems


@pytest.mark.parametrize("overlay", ["pool-gpu", "pool-cpu", "llm"])
def test_secure_component_secures_a_pool_or_the_llm_worker(
    render: Render, tmp_path: Path, overlay: str
) -> None:
    """Adding `components: [../../components/secure]` to a copy of the overlay."""
    copy = tmp_path / overlay
    shutil.copytree(K8S / "overlays" / overlay, copy)
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    # Folders outside the copy by their new relative path; files were copied along.
    kustomization["resources"] = [
        os.path.relpath((K8S / "overlays" / overlay / r).resolve(), copy)
        if r.startswith("..")
        else r
        for r in kustomization["resources"]
    ]
    kustomization["components"] = [os.path.relpath(K8S / "components" / "secure", copy)]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    docs = render(copy)
    assert validate_manifests(docs) == []
    assert _check_secured(docs) == []
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = json.dumps(deployment["spec"]["template"]["spec"]["volumes"])
    if overlay == "llm":
        assert env["INFERBUS_LLM_NATS_USER"] == "llm"
    else:
        assert env["INFERBUS_WORKER_NATS_USER"] == "worker"
        assert env["INFERBUS_WORKER_REGISTRY_TOKEN_FILE"] == "/etc/inferbus/registry/reader.token"
        # Workers never see the admin token.
        assert "admin.token" not in volumes


def test_nats_helm_values_include_the_mounted_auth_file() -> None:
    values = yaml.safe_load((K8S / "components" / "secure" / "nats-values.yaml").read_text())
    include = values["config"]["merge"]["$include"]
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"]]
    assert mount["name"] == volume["name"]
    # The chart's main file is /etc/nats-config/nats.conf; includes are relative to it.
    assert (
        f"/etc/nats-config/{include.removeprefix('./')}" == f"{mount['mountPath']}/nats-auth.conf"
    )
    assert values["config"]["jetstream"]["enabled"] is True


def test_secure_override_keeps_the_optional_workers_behind_their_profiles(
    compose_cli: Any, secrets_dir: Path
) -> None:
    env_file = secrets_dir.parent / "compose.env"
    env_file.write_text(ENV_EXAMPLE.read_text() + f"\nINFERBUS_SECRETS_DIR={secrets_dir}\n")
    result = compose_cli.run(
        "-f", str(COMPOSE_FILE), "-f", str(SECURE_COMPOSE_FILE),
        "--project-directory", str(COMPOSE_FILE.parent), "--env-file", str(env_file),
        "config", "--format", "json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    services = set(json.loads(result.stdout)["services"])
    assert {"gateway", "worker-gpu", "nats-1", "nats-2", "nats-3", "redis"} <= services
    assert not {"worker-cpu", "worker-llm"} & services
