"""deploy/k8s: every overlay renders with `kubectl kustomize` and passes strict
schema validation (kubernetes-validate for built-in kinds, our own KEDA schema
for ScaledObjects), and the manifests agree with the services' real settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inferbus_common.subjects import Subjects, subject_token

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
POOL_OVERLAYS = [name for name in OVERLAYS if name.startswith("pool-")]
KEDA_SCHEMA = json.loads((Path(__file__).parent / "keda_scaledobject.schema.json").read_text())
# Kinds validated by our own schema instead of the Kubernetes API schemas.
CRD_KINDS = {"ScaledObject"}
K8S_VERSION = "1.32.0"

Manifest = dict[str, Any]
Render = Callable[[Path], list[Manifest]]


def _of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def _containers(docs: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    for deployment in _of_kind(docs, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


def _env(container: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def validate_manifests(docs: list[Manifest]) -> list[str]:
    """Strict validation of every document; returns the errors (empty = valid)."""
    errors = []
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("kind") in CRD_KINDS:
            validator = jsonschema.Draft202012Validator(KEDA_SCHEMA)
            errors += [f"{name}: {e.message}" for e in validator.iter_errors(doc)]
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {exc.message}")
    return errors


def test_overlays_exist() -> None:
    assert {"dev", "prod", "pool-gpu", "pool-cpu", "llm", "secure"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(render: Render, overlay: str) -> None:
    docs = render(K8S / "overlays" / overlay)
    assert docs
    assert validate_manifests(docs) == []
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace"), f"{doc['kind']}/{doc['metadata']['name']}"


def test_broken_deployment_with_a_typoed_field_fails(render: Render) -> None:
    docs = render(K8S / "overlays" / "prod")
    deployment = json.loads(json.dumps(_of_kind(docs, "Deployment")[0]))
    template = deployment["spec"]["template"]["spec"]
    template["containers"][0]["readinessProbes"] = template["containers"][0].pop("readinessProbe")
    errors = validate_manifests([deployment])
    assert len(errors) == 1
    assert "readinessProbes" in errors[0]


def test_broken_scaledobject_with_a_typoed_trigger_field_fails(render: Render) -> None:
    docs = render(K8S / "overlays" / "pool-gpu")
    scaled = json.loads(json.dumps(_of_kind(docs, "ScaledObject")[0]))
    metadata = scaled["spec"]["triggers"][0]["metadata"]
    metadata["lagTreshold"] = metadata.pop("lagThreshold")
    errors = validate_manifests([scaled])
    assert any("lagTreshold" in e for e in errors), errors
    assert any("'lagThreshold' is a required property" in e for e in errors), errors


def test_broken_kustomization_fails_to_render(
    kustomize: Callable[[Path], subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(K8S / "base", overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [base],
                "patches": [{"path": "missing-deployment.yaml"}],
            }
        )
    )
    (overlay / "missing-deployment.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: no-such-service\n"
    )
    result = kustomize(overlay)
    assert result.returncode != 0
    assert "no-such-service" in result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_the_real_endpoints(render: Render, overlay: str) -> None:
    for deployment, container in _containers(render(K8S / "overlays" / overlay)):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = _env(container)
        prefix = next(k for k in env if k.endswith("_METRICS_PORT")).removesuffix("METRICS_PORT")
        # The metrics port the process binds is the one the probes ask.
        assert ports["metrics"] == int(env[f"{prefix}METRICS_PORT"])
        # The Go edge answers /livez (process up); the Python services /healthz.
        alive = "/livez" if container["name"] == "edge" else "/healthz"
        for probe in ("livenessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert (get["path"], get["port"]) == (alive, "metrics"), deployment["metadata"]
        ready = container["readinessProbe"]["httpGet"]
        if container["name"] == "gateway":
            assert ports["http"] == int(env["INFERBUS_GATEWAY_HTTP_PORT"])
            assert (ready["path"], ready["port"]) == ("/v2/health/ready", "http")
        else:
            assert (ready["path"], ready["port"]) == ("/readyz", "metrics")


def _pre_stop_seconds(container: Manifest) -> float:
    """How long preStop waits: `exec: sleep N` or the kubelet's own `sleep` action."""
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


def _drain_seconds(container: Manifest) -> float:
    """The drain budget: *_DRAIN_TIMEOUT_S (Python services) or the edge's -drain flag."""
    for key, value in _env(container).items():
        if key.endswith("_DRAIN_TIMEOUT_S"):
            return float(value)
    (flag,) = [a for a in container.get("args", []) if a.startswith("-drain=")]
    value = flag.removeprefix("-drain=")
    assert value.endswith("s") and value[:-1].isdigit(), flag
    return float(value[:-1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(render: Render, overlay: str) -> None:
    for deployment, container in _containers(render(K8S / "overlays" / overlay)):
        pod = deployment["spec"]["template"]["spec"]
        pre_stop = _pre_stop_seconds(container)
        drain = _drain_seconds(container)
        # SIGTERM comes after preStop; the process then drains for up to `drain`.
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, deployment["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_requests_a_service_and_a_pdb(render: Render, overlay: str) -> None:
    docs = render(K8S / "overlays" / overlay)
    services = _of_kind(docs, "Service")
    pdbs = _of_kind(docs, "PodDisruptionBudget")
    for deployment, container in _containers(docs):
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), deployment["metadata"]["name"]
        assert "memory" in container["resources"]["limits"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

        def selects(selector: dict[str, str], labels: dict[str, str] = labels) -> bool:
            return selector.items() <= labels.items()

        assert any(selects(s["spec"]["selector"]) for s in services), deployment["metadata"]
        assert any(selects(p["spec"]["selector"]["matchLabels"]) for p in pdbs)


def test_pool_deployments_never_select_each_others_pods(render: Render) -> None:
    deployments = [
        d
        for overlay in POOL_OVERLAYS
        for d in _of_kind(render(K8S / "overlays" / overlay), "Deployment")
    ] + _of_kind(render(K8S / "overlays" / "prod"), "Deployment")
    for a in deployments:
        for b in deployments:
            if a is b:
                continue
            selector = a["spec"]["selector"]["matchLabels"].items()
            assert not selector <= b["spec"]["template"]["metadata"]["labels"].items(), (
                a["metadata"]["name"],
                b["metadata"]["name"],
            )


def test_gateway_has_an_hpa(render: Render) -> None:
    for overlay in ("dev", "prod"):
        docs = render(K8S / "overlays" / overlay)
        (hpa,) = _of_kind(docs, "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": "gateway",
        }
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        (gateway,) = [d for d in _of_kind(docs, "Deployment") if d["metadata"]["name"] == "gateway"]
        assert "replicas" not in gateway["spec"], "the HPA owns the gateway's replica count"


def test_prod_ships_no_placeholder_secrets_and_dev_does(render: Render) -> None:
    assert _of_kind(render(K8S / "overlays" / "prod"), "Secret") == []
    dev = render(K8S / "overlays" / "dev")
    secrets = {s["metadata"]["name"]: s["stringData"] for s in _of_kind(dev, "Secret")}
    # Every secretKeyRef resolves to a key of a rendered Secret, every
    # configMapRef to a rendered ConfigMap.
    config_maps = {c["metadata"]["name"] for c in _of_kind(dev, "ConfigMap")}
    for _, container in _containers(dev):
        for ref in container.get("envFrom", []):
            assert ref["configMapRef"]["name"] in config_maps
        for value in _env(container).values():
            if isinstance(value, dict) and "secretKeyRef" in value:
                ref = value["secretKeyRef"]
                assert ref["key"] in secrets[ref["name"]], ref


@pytest.mark.parametrize("overlay", POOL_OVERLAYS)
def test_pool_overlay_scales_its_pool_on_jetstream_lag(render: Render, overlay: str) -> None:
    pool = overlay.removeprefix("pool-")
    docs = render(K8S / "overlays" / overlay)
    (deployment,) = _of_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert _env(container)["INFERBUS_WORKER_POOL"] == pool
    assert "replicas" not in deployment["spec"], "KEDA owns the worker replica count"
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus is not None) == (pool == "gpu")
    if pool == "gpu":
        assert gpus >= 1
        assert container["image"].startswith("inferbus/worker-gpu:")

    (scaled,) = _of_kind(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert 0 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    subjects = Subjects()
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "nats-jetstream"
        assert meta["stream"] == subjects.batch_stream
        # Consumers are named by inferbus_common.subjects: w_<pool>__<model>__<version>.
        assert meta["consumer"].startswith(f"w_{subject_token(pool)}__"), meta["consumer"]
        _, model, version = meta["consumer"].removeprefix("w_").split("__")
        assert subjects.batch_consumer(pool, model, version) == meta["consumer"]


def test_adding_a_pool_is_one_small_overlay(render: Render, tmp_path: Path) -> None:
    """Copy pool-cpu, rename the pool: it renders a separate, valid pool."""
    overlay = tmp_path / "pool-edge"
    shutil.copytree(K8S / "overlays" / "pool-cpu", overlay)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    kustomization["resources"] = [os.path.relpath(K8S / "worker-pool", overlay)]
    kustomization["nameSuffix"] = "-edge"
    kustomization["labels"][0]["pairs"]["inferbus.io/pool"] = "edge"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    for name in ("worker.yaml", "scaledobject.yaml"):
        path = overlay / name
        text = path.read_text().replace("value: cpu", "value: edge")
        path.write_text(text.replace("w_cpu__", "w_edge__"))
    docs = render(overlay)
    assert validate_manifests(docs) == []
    (deployment,) = _of_kind(docs, "Deployment")
    assert deployment["metadata"]["name"] == "worker-edge"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert _env(container)["INFERBUS_WORKER_POOL"] == "edge"
    (scaled,) = _of_kind(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "worker-edge"
    assert scaled["spec"]["triggers"][0]["metadata"]["consumer"] == "w_edge__fraud__1"


def test_llm_overlay_runs_the_vllm_image_on_one_gpu(render: Render) -> None:
    docs = render(K8S / "overlays" / "llm")
    (deployment,) = _of_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "inferbus/worker-llm:0.1.0"
    env = _env(container)
    assert env["INFERBUS_LLM_POOL"] == "llm"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 8052}
    for limits in (container["resources"]["requests"], container["resources"]["limits"]):
        assert limits["nvidia.com/gpu"] == 1
    # vLLM shares tensors between its processes through /dev/shm.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # No batch-queue consumer, so no KEDA ScaledObject.
    assert _of_kind(docs, "ScaledObject") == []


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_services_know_every_nats_node_and_keep_3_replicas(render: Render, overlay: str) -> None:
    """The NATS chart's values make nats-0..2 behind nats-headless; every service
    is given all three, and what it creates keeps a replica on each."""
    values = yaml.safe_load((K8S / "nats" / "values.yaml").read_text())
    assert values["config"]["cluster"]["enabled"] is True
    nodes = values["config"]["cluster"]["replicas"]
    assert nodes == 3
    assert values["config"]["jetstream"]["enabled"] is True
    [common] = [
        d
        for d in _of_kind(render(K8S / "overlays" / overlay), "ConfigMap")
        if d["metadata"]["name"] == "inferbus-common"
    ]
    urls = common["data"]["NATS_URL"].split(",")
    assert urls == [f"nats://nats-{i}.nats-headless.nats.svc.cluster.local:4222" for i in range(3)]
    assert common["data"]["JETSTREAM_REPLICAS"] == str(nodes)


# ---------------------------------------------------------------- the gRPC edge

EDGE_PORTS = {"grpc": 8003, "metrics": 8004}
EDGE_PROBES = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}


def _named(docs: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {d["metadata"]["name"]: d for d in _of_kind(docs, kind)}


def edge_problems(docs: list[Manifest]) -> list[str]:
    """What is wrong with the gRPC edge (services/edge) in rendered manifests
    that also hold the gateway (empty = nothing)."""
    deployments, services = _named(docs, "Deployment"), _named(docs, "Service")
    if "edge" not in deployments or "edge" not in services:
        return ["no edge Deployment or no edge Service"]
    problems = []
    edge, gateway = deployments["edge"], deployments["gateway"]
    pod, gateway_pod = edge["spec"]["template"]["spec"], gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (gateway_container,) = gateway_pod["containers"]
    env = _env(container)

    # The image: the gateway's repository and tag, image name `edge`.
    expected_image = gateway_container["image"].replace("/gateway:", "/edge:")
    if container["image"] != expected_image:
        problems.append(f"image {container['image']}, expected {expected_image}")

    # Ports: the process binds what the container and the Service declare.
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if ports != EDGE_PORTS:
        problems.append(f"container ports {ports}")
    for name, setting in (("grpc", "GRPC_PORT"), ("metrics", "METRICS_PORT")):
        if env.get(f"INFERBUS_EDGE_{setting}") != str(ports.get(name)):
            problems.append(f"INFERBUS_EDGE_{setting} is not the {name} port {ports.get(name)}")
    if env.get("INFERBUS_EDGE_HOST") != "0.0.0.0":
        problems.append(f"INFERBUS_EDGE_HOST={env.get('INFERBUS_EDGE_HOST')!r}: not reachable")
    service = services["edge"]["spec"]
    if not service["selector"].items() <= edge["spec"]["template"]["metadata"]["labels"].items():
        problems.append("the edge Service does not select the edge pods")
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["ports"]}
    if service_ports != {name: (port, name) for name, port in EDGE_PORTS.items()}:
        problems.append(f"Service ports {service_ports}")
    if any(p["name"] == "grpc" and p.get("appProtocol") != "grpc" for p in service["ports"]):
        problems.append("the Service's grpc port has no appProtocol grpc")

    # Health: /livez and /readyz (NATS connected), plain HTTP on the metrics port.
    for probe, path in EDGE_PROBES.items():
        get = container.get(probe, {}).get("httpGet", {})
        asked = (get.get("path"), get.get("port"), get.get("scheme", "HTTP"))
        if asked != (path, "metrics", "HTTP"):
            problems.append(f"{probe} asks {get}, expected {path} on metrics")

    # Scraped like the gateway: the same prometheus.io annotations, its own port.
    annotations = edge["spec"]["template"]["metadata"].get("annotations", {})
    gateway_annotations = gateway["spec"]["template"]["metadata"].get("annotations", {})
    expected = {k: v for k, v in gateway_annotations.items() if k.startswith("prometheus.io/")}
    expected["prometheus.io/port"] = str(EDGE_PORTS["metrics"])
    scrape = {k: v for k, v in annotations.items() if k.startswith("prometheus.io/")}
    if len(expected) < 3 or scrape != expected:
        problems.append(f"prometheus annotations {scrape}, expected {expected}")

    # Non-root with a read-only root, exactly as the gateway.
    security = pod.get("securityContext", {})
    if not security.get("runAsNonRoot") or security.get("runAsUser") != 10001:
        problems.append(f"pod securityContext {security}: not uid 10001, non-root")
    if security != gateway_pod["securityContext"]:
        problems.append("pod securityContext differs from the gateway's")
    if container.get("securityContext") != gateway_container["securityContext"]:
        problems.append("container securityContext differs from the gateway's")
    if not container.get("securityContext", {}).get("readOnlyRootFilesystem"):
        problems.append("the root filesystem is writable")

    # The bus: the same NATS nodes and subject prefix as the gateway (its envFrom).
    config_maps = {d["metadata"]["name"]: d["data"] for d in _of_kind(docs, "ConfigMap")}
    gateway_maps = [s["configMapRef"]["name"] for s in gateway_container.get("envFrom", [])]
    for key in ("NATS_URL", "SUBJECT_PREFIX"):
        ref = (env.get(f"INFERBUS_EDGE_{key}") or {}).get("configMapKeyRef", {})
        if ref.get("key") != key or ref.get("name") not in gateway_maps:
            problems.append(f"INFERBUS_EDGE_{key} is not the gateway's ConfigMap value: {ref}")
        elif key not in config_maps.get(ref["name"], {}):
            problems.append(f"ConfigMap {ref['name']} has no {key}")

    # Upstream: the gateway Service's gRPC port, which is the gateway's own.
    gateway_grpc = next(p for p in services["gateway"]["spec"]["ports"] if p["name"] == "grpc")
    if env.get("INFERBUS_EDGE_UPSTREAM") != f"gateway:{gateway_grpc['port']}":
        problems.append(f"INFERBUS_EDGE_UPSTREAM={env.get('INFERBUS_EDGE_UPSTREAM')!r}")
    gateway_ports = {p["name"]: p["containerPort"] for p in gateway_container["ports"]}
    if _env(gateway_container)["INFERBUS_GATEWAY_GRPC_PORT"] != str(gateway_ports["grpc"]):
        problems.append("the gateway's gRPC port is not the one its Service names")

    # Shutdown: the image has no shell (FROM scratch), so no `exec` preStop; the
    # grace period covers preStop, the 10 s drain and some slack.
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" not in pre_stop:
        problems.append(f"preStop {pre_stop}: the edge image has no `sleep` binary")
    elif pod["terminationGracePeriodSeconds"] < max(
        15, _pre_stop_seconds(container) + _drain_seconds(container) + 5
    ):
        problems.append(f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']}")
    if edge["spec"].get("replicas", 1) < 1:
        problems.append("no replicas")
    return problems


@pytest.mark.parametrize("path", ["base", "overlays/dev", "overlays/prod", "overlays/secure"])
def test_edge_runs_beside_the_gateway(render: Render, path: str) -> None:
    docs = render(K8S / path)
    assert edge_problems(docs) == []
    pdbs = _named(docs, "PodDisruptionBudget")
    assert pdbs["edge"]["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "edge"}
    assert validate_manifests([d for d in docs if d["metadata"]["name"] == "edge"]) == []


def test_edge_in_prod_is_spread_behind_a_load_balancer_with_the_pinned_tag(render: Render) -> None:
    docs = render(K8S / "overlays" / "prod")
    edge = _named(docs, "Deployment")["edge"]
    assert edge["metadata"]["namespace"] == "inferbus"
    assert edge["spec"]["replicas"] >= 2
    (container,) = edge["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "inferbus/edge:0.1.0"
    spread = edge["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    assert all(
        c["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "edge"} for c in spread
    )
    assert _named(docs, "Service")["edge"]["spec"]["type"] == "LoadBalancer"
    dev = _named(render(K8S / "overlays" / "dev"), "Deployment")["edge"]
    assert dev["spec"]["template"]["spec"]["containers"][0]["image"] == "inferbus/edge:dev"


def test_edge_checker_catches_a_broken_edge(render: Render) -> None:
    docs = json.loads(json.dumps(render(K8S / "overlays" / "prod")))
    assert edge_problems([d for d in docs if d["metadata"]["name"] != "edge"]) == [
        "no edge Deployment or no edge Service"
    ]
    edge = _named(docs, "Deployment")["edge"]
    pod = edge["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["readinessProbe"]["httpGet"]["path"] = "/healthz"
    pod["securityContext"]["runAsNonRoot"] = False
    container["lifecycle"]["preStop"] = {"exec": {"command": ["sleep", "5"]}}
    container["env"] = [e for e in container["env"] if e["name"] != "INFERBUS_EDGE_UPSTREAM"]
    for item in container["env"]:
        if item["name"] == "INFERBUS_EDGE_METRICS_PORT":
            item["value"] = "9999"
    edge["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "8003"
    problems = edge_problems(docs)
    expected = (
        "readinessProbe asks",
        "pod securityContext",
        "preStop",
        "INFERBUS_EDGE_UPSTREAM=None",
        "INFERBUS_EDGE_METRICS_PORT is not the metrics port",
        "prometheus annotations",
    )
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)
