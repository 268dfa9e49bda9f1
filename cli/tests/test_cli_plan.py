"""What `up` would start: order, command lines, env and port claims (nothing is started)."""

from __future__ import annotations

import sys
from pathlib import Path

from inferbus_cli.plan import (
    Ports,
    S3Options,
    UpOptions,
    nats_node_spec,
    nats_spec,
    pinned_spec,
    port_claims,
    process_names,
    process_stages,
    redis_spec,
    redis_url,
    service_spec,
)
from inferbus_cli.supervisor import RestartPolicy

ENDPOINTS = {
    "nats": "nats://127.0.0.1:14222",
    "registry": "127.0.0.1:18070",
    "redis": "127.0.0.1:16379",
}


def test_start_order(tmp_path: Path) -> None:
    options = UpOptions(home=tmp_path, workers=2)
    assert process_names(options, with_redis=True) == [
        "nats",
        "redis",
        "registry",
        "router",
        "batcher",
        "worker-1",
        "worker-2",
        "gateway",
    ]
    assert "redis" not in process_names(options, with_redis=False)


def test_nats_free_port_uses_random_port_and_ports_file(tmp_path: Path) -> None:
    options = UpOptions(home=tmp_path, ports=Ports(nats=0, nats_monitor=0))
    spec = nats_spec(options, "/bin/nats-server")
    argv = spec.argv
    assert argv[argv.index("-p") + 1] == "-1"
    assert argv[argv.index("-m") + 1] == "-1"
    assert "-js" in argv
    assert argv[argv.index("-sd") + 1] == str(tmp_path / "nats")
    assert argv[argv.index("--ports_file_dir") + 1] == str(tmp_path / "run")
    assert spec.log == tmp_path / "logs" / "nats.log"
    fixed = nats_spec(UpOptions(home=tmp_path), "/bin/nats-server").argv
    assert fixed[fixed.index("-p") + 1] == "4222"


def test_redis_port_zero_is_a_unix_socket(tmp_path: Path) -> None:
    spec = redis_spec(UpOptions(home=tmp_path, ports=Ports(redis=0)), "/bin/redis-server")
    assert spec.redis_address == str(tmp_path / "run" / "redis.sock")
    assert spec.argv[spec.argv.index("--port") + 1] == "0"
    assert redis_url(spec.redis_address) == f"unix://{tmp_path / 'run' / 'redis.sock'}"
    tcp = redis_spec(UpOptions(home=tmp_path), "/bin/redis-server")
    assert tcp.redis_address == "127.0.0.1:6379"
    assert redis_url(tcp.redis_address) == "redis://127.0.0.1:6379/0"


def test_service_env(tmp_path: Path) -> None:
    options = UpOptions(home=tmp_path, workers=2)
    registry = service_spec(options, "registry", ENDPOINTS)
    assert registry.argv == [sys.executable, "-m", "inferbus_registry"]
    assert registry.env["INFERBUS_REGISTRY_NATS_URL"] == ENDPOINTS["nats"]
    assert registry.env["INFERBUS_REGISTRY_GRPC_PORT"] == "8070"
    assert registry.env["INFERBUS_REGISTRY_METRICS_PORT"] == "8042"
    assert registry.env["INFERBUS_REGISTRY_STORE"] == "local"
    assert registry.env["INFERBUS_REGISTRY_STORE_DIR"] == str(tmp_path / "models")
    assert registry.env["INFERBUS_REGISTRY_PORTS_FILE"] == str(tmp_path / "run" / "registry.json")
    assert registry.ports_file == tmp_path / "run" / "registry.json"

    worker2 = service_spec(options, "worker-2", ENDPOINTS)
    assert worker2.argv[-1] == "inferbus_worker"
    assert worker2.env["INFERBUS_WORKER_METRICS_PORT"] == "8033"
    assert worker2.env["INFERBUS_WORKER_REGISTRY_URL"] == "127.0.0.1:18070"
    assert worker2.env["INFERBUS_WORKER_CACHE_DIR"] == str(tmp_path / "cache" / "worker-2")
    assert worker2.log == tmp_path / "logs" / "worker-2.log"

    gateway = service_spec(options, "gateway", ENDPOINTS)
    assert gateway.env["INFERBUS_GATEWAY_HTTP_PORT"] == "8000"
    assert gateway.env["INFERBUS_GATEWAY_GRPC_PORT"] == "8001"
    assert gateway.env["INFERBUS_GATEWAY_METRICS_PORT"] == "8002"
    assert gateway.env["INFERBUS_GATEWAY_REDIS_URL"] == "redis://127.0.0.1:16379/0"
    no_redis = service_spec(options, "gateway", {"nats": ENDPOINTS["nats"]})
    assert no_redis.env["INFERBUS_GATEWAY_REDIS_URL"] == ""

    for name, port in [("router", "8012"), ("batcher", "8022")]:
        spec = service_spec(options, name, ENDPOINTS)
        assert spec.env[f"INFERBUS_{name.upper()}_METRICS_PORT"] == port


def test_s3_store_env(tmp_path: Path) -> None:
    options = UpOptions(
        home=tmp_path, store="s3", s3=S3Options("127.0.0.1:9100", "ak", "sk", "bkt", False)
    )
    env = service_spec(options, "registry", ENDPOINTS).env
    assert env["INFERBUS_REGISTRY_STORE"] == "s3"
    assert env["INFERBUS_REGISTRY_S3_ENDPOINT"] == "127.0.0.1:9100"
    assert env["INFERBUS_REGISTRY_S3_ACCESS_KEY"] == "ak"
    assert env["INFERBUS_REGISTRY_S3_SECRET_KEY"] == "sk"
    assert env["INFERBUS_REGISTRY_S3_BUCKET"] == "bkt"
    assert env["INFERBUS_REGISTRY_S3_SECURE"] == "false"
    assert "INFERBUS_REGISTRY_STORE_DIR" not in env


def test_env_names_are_real_settings_fields(tmp_path: Path) -> None:
    """Every variable set matches a field of that service's settings class."""
    from inferbus_batcher.settings import BatcherSettings
    from inferbus_gateway.settings import GatewaySettings
    from inferbus_registry.settings import RegistrySettings
    from inferbus_router.settings import RouterSettings
    from inferbus_worker.settings import WorkerSettings

    classes = {
        "registry": RegistrySettings,
        "router": RouterSettings,
        "batcher": BatcherSettings,
        "worker-1": WorkerSettings,
        "gateway": GatewaySettings,
    }
    for name, cls in classes.items():
        spec = service_spec(UpOptions(home=tmp_path), name, ENDPOINTS)
        prefix = cls.model_config["env_prefix"]
        for key in spec.env:
            assert key.startswith(prefix)
            assert key.removeprefix(prefix).lower() in cls.model_fields, key


def test_port_claims_cover_every_fixed_port(tmp_path: Path) -> None:
    claims = port_claims(UpOptions(home=tmp_path, workers=2), with_redis=True)
    by_port = {c.port: c.flag for c in claims}
    assert by_port[4222] == "--nats-port"
    assert by_port[8222] == "--nats-monitor-port"
    assert by_port[6379] == "--redis-port"
    assert by_port[8000] == "--http-port"
    assert by_port[8001] == "--grpc-port"
    assert by_port[8002] == "--metrics-port"
    assert by_port[8070] == "--registry-port"
    assert by_port[8032] == by_port[8033] == "--worker-metrics-port"
    assert 6379 not in {c.port for c in port_claims(UpOptions(home=tmp_path), with_redis=False)}


def test_a_nats_cluster_starts_first_and_every_service_gets_every_node(tmp_path: Path) -> None:
    options = UpOptions(home=tmp_path, nats_cluster=3)
    assert process_stages(options, with_redis=False)[0] == ["nats-1", "nats-2", "nats-3"]
    cluster_ports = [16222, 16223, 16224]
    argv = nats_node_spec(options, "/bin/nats-server", 1, cluster_ports).argv
    assert argv[argv.index("-p") + 1] == "4223"
    assert argv[argv.index("-m") + 1] == "8223"
    assert argv[argv.index("--server_name") + 1] == "nats-2"
    assert argv[argv.index("--cluster") + 1] == "nats://127.0.0.1:16223"
    routes = argv[argv.index("--routes") + 1].split(",")
    assert routes == [f"nats://127.0.0.1:{p}" for p in cluster_ports]
    assert argv[argv.index("-sd") + 1] == str(tmp_path / "nats" / "nats-2")
    urls = "nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224"
    env = service_spec(options, "router", {**ENDPOINTS, "nats": urls}).env
    assert env["INFERBUS_ROUTER_NATS_URL"] == urls
    assert env["INFERBUS_ROUTER_JETSTREAM_REPLICAS"] == "3"
    single = service_spec(UpOptions(home=tmp_path), "router", ENDPOINTS).env
    assert single["INFERBUS_ROUTER_JETSTREAM_REPLICAS"] == "1"
    claimed = {c.port for c in port_claims(options, with_redis=False)}
    assert {4222, 4223, 4224, 8222, 8223, 8224, 6222, 6223, 6224} <= claimed


def test_a_restart_keeps_the_ports_the_process_had(tmp_path: Path) -> None:
    options = UpOptions(home=tmp_path, ports=Ports(**dict.fromkeys(Ports.__dataclass_fields__, 0)))
    gateway = service_spec(options, "gateway", ENDPOINTS)
    assert gateway.env["INFERBUS_GATEWAY_GRPC_PORT"] == "0"
    pinned = pinned_spec(gateway, {"grpc": 41001, "http": 41000, "metrics": 41002})
    assert pinned.env["INFERBUS_GATEWAY_GRPC_PORT"] == "41001"
    assert pinned.env["INFERBUS_GATEWAY_HTTP_PORT"] == "41000"
    assert pinned.env["INFERBUS_GATEWAY_METRICS_PORT"] == "41002"
    assert gateway.env["INFERBUS_GATEWAY_GRPC_PORT"] == "0", "the original spec is unchanged"
    bound = {"client": 44222, "monitoring": 48222}
    nats = pinned_spec(nats_spec(options, "/bin/nats-server"), bound)
    assert nats.argv[nats.argv.index("-p") + 1] == "44222"
    assert nats.argv[nats.argv.index("-m") + 1] == "48222"


def test_restart_back_off_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(initial_s=0.5, max_s=4.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_gateway_group_joins_the_first_gateways_ports(tmp_path: Path) -> None:
    from inferbus_cli.parser import auto_gateways

    options = UpOptions(home=tmp_path, gateways=3)
    stages = process_stages(options, with_redis=True)
    assert stages[-2][-1] == "gateway"
    assert stages[-1] == ["gateway-2", "gateway-3"], "the others start once the first is up"
    first = service_spec(options, "gateway", ENDPOINTS)
    assert first.env["INFERBUS_GATEWAY_PORT_GROUP"] == "first"
    assert first.env["INFERBUS_GATEWAY_GRPC_PORT"] == "8001"
    up = ENDPOINTS | {"gateway_grpc": "127.0.0.1:41001", "gateway_http": "http://127.0.0.1:41000"}
    other = service_spec(options, "gateway-2", up)
    assert other.env["INFERBUS_GATEWAY_PORT_GROUP"] == "join"
    assert other.env["INFERBUS_GATEWAY_GRPC_PORT"] == "41001"
    assert other.env["INFERBUS_GATEWAY_HTTP_PORT"] == "41000"
    assert other.env["INFERBUS_GATEWAY_METRICS_PORT"] == "0"
    assert other.log.name == "gateway-2.log"
    # Restarted while the others hold the ports, the first one joins them.
    again = pinned_spec(first, {"grpc": 8001, "http": 8000, "metrics": 8002})
    assert again.env["INFERBUS_GATEWAY_PORT_GROUP"] == "join"
    # One gateway alone binds its ports alone.
    alone = service_spec(UpOptions(home=tmp_path), "gateway", ENDPOINTS)
    assert "INFERBUS_GATEWAY_PORT_GROUP" not in alone.env
    assert [auto_gateways(n) for n in (1, 2, 4, 8, 16, 64, None)] == [1, 1, 1, 2, 4, 8, 1]
