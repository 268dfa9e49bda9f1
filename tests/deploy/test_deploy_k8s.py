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
        for probe in ("livenessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert (get["path"], get["port"]) == ("/healthz", "metrics"), deployment["metadata"]
        ready = container["readinessProbe"]["httpGet"]
        if container["name"] == "gateway":
            assert ports["http"] == int(env["INFERBUS_GATEWAY_HTTP_PORT"])
            assert (ready["path"], ready["port"]) == ("/v2/health/ready", "http")
        else:
            assert (ready["path"], ready["port"]) == ("/readyz", "metrics")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(render: Render, overlay: str) -> None:
    for deployment, container in _containers(render(K8S / "overlays" / overlay)):
        pod = deployment["spec"]["template"]["spec"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        pre_stop = float(command[1])
        drain = next(float(v) for k, v in _env(container).items() if k.endswith("_DRAIN_TIMEOUT_S"))
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
