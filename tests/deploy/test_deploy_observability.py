"""Prometheus scrape config, alert rules and the Grafana dashboard of compose/:
they scrape the real ports and query only metrics that the services (or the NATS
exporter) really export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferbus_common.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "compose" / "prometheus"
GRAFANA = REPO / "compose" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "inferbus.json"
OPERATIONS = REPO / "docs" / "operations.md"

# Series of prometheus-nats-exporter (-varz -jsz=all) the rules and dashboard use.
NATS_EXPORTER_SERIES = {"jetstream_consumer_num_pending"}
_METRIC = re.compile(
    r"""(Counter|Gauge|Histogram|Summary)(?:MetricFamily)?\(\s*["']([a-zA-Z_:][a-zA-Z0-9_:]*)["']"""
)
# Metric names in PromQL; `level:metric:operation` recording-rule names are not metrics.
_USED = re.compile(r"(?<![:\w])((?:inferbus|jetstream)_[a-z0-9_]+)(?![:\w])")
_RECORDED = re.compile(r"(?<![\w])([a-z_]+:[a-z0-9_]+:[a-z0-9_]+)")
# Scrape job → (compose service whose replicas it finds, settings env prefix).
SCRAPED = {
    "inferbus-gateway": ("gateway", "INFERBUS_GATEWAY_"),
    "inferbus-router": ("router", "INFERBUS_ROUTER_"),
    "inferbus-batcher": ("batcher", "INFERBUS_BATCHER_"),
    "inferbus-worker": ("worker-gpu", "INFERBUS_WORKER_"),
    "inferbus-worker-cpu": ("worker-cpu", "INFERBUS_WORKER_"),
    "inferbus-registry": ("registry", "INFERBUS_REGISTRY_"),
    "inferbus-llm": ("worker-llm", "INFERBUS_LLM_"),
}


def exported_series() -> set[str]:
    """Every series name the services' prometheus_client metrics produce."""
    series = set()
    for source in (REPO / "services").glob("*/src/**/*.py"):
        for kind, name in _METRIC.findall(source.read_text()):
            if kind == "Counter":
                base = name.removesuffix("_total")
                series |= {f"{base}_total", f"{base}_created"}
            elif kind in ("Histogram", "Summary"):
                series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
            else:
                series.add(name)
    return series


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_metric_name_scan_finds_the_services_metrics() -> None:
    series = exported_series()
    assert "inferbus_gateway_requests_total" in series
    assert "inferbus_gateway_request_duration_seconds_bucket" in series
    assert "inferbus_worker_batches_total" in series


@pytest.mark.parametrize("source", ["alerts", "dashboard"], ids=["alerts.yml", "grafana-dashboard"])
def test_queries_use_only_metrics_that_exist(source: str) -> None:
    exprs = [r["expr"] for r in alert_rules()] if source == "alerts" else dashboard_exprs()
    assert exprs
    known = exported_series() | NATS_EXPORTER_SERIES
    used = {name for expr in exprs for name in _USED.findall(expr)}
    assert used, "no metric found in the queries"
    assert used - known == set()
    recorded = {r["record"] for r in alert_rules() if "record" in r}
    assert {name for expr in exprs for name in _RECORDED.findall(expr)} <= recorded


def test_alerts_cover_the_required_conditions() -> None:
    alerts = {r["alert"]: r for r in alert_rules() if "alert" in r}
    required = {
        "InferbusLatencyP99AboveSLO",
        "InferbusErrorRateHigh",
        "InferbusQueueLagGrowing",
        "InferbusBreakerOpen",
        "InferbusWorkerDown",
    }
    assert required <= set(alerts)
    headings = {
        re.sub(r"[^a-z0-9-]", "", line.lstrip("#").strip().lower().replace(" ", "-"))
        for line in OPERATIONS.read_text().splitlines()
        if line.startswith("#")
    }
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"page", "warning"}, name
        runbook = rule["annotations"]["runbook"]
        path, _, anchor = runbook.partition("#")
        assert path == "docs/operations.md" and anchor in headings, (name, runbook)


def test_every_service_metrics_port_is_scraped(
    compose_model: dict[str, Any],
    settings_by_prefix: dict[str, type[ServiceSettings]],
) -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(SCRAPED) <= set(jobs)
    for job_name, (service, prefix) in SCRAPED.items():
        (sd,) = jobs[job_name]["dns_sd_configs"]
        assert sd["names"] == [service]
        env = compose_model["services"][service]["environment"]
        port = int(env[f"{prefix}METRICS_PORT"])
        assert sd["port"] == port, job_name
        # ...and it is the service's documented default port.
        assert settings_by_prefix[prefix].model_fields["metrics_port"].default == port
    assert "alerts.yml" in " ".join(config["rule_files"])


def test_dashboard_is_provisioned_with_its_datasource() -> None:
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "datasources.yml").read_text()
    )["datasources"]
    uids = {d["uid"] for d in datasources}
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("traffic", "error", "latency", "saturation", "stage", "batch fill"):
        assert topic in titles, topic
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] in uids
            assert panel["targets"]
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text()
    )["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_promtool_accepts_the_config_and_the_rule_unit_tests() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    for args in (
        ["check", "config", str(PROMETHEUS / "prometheus.yml")],
        ["test", "rules", str(Path(__file__).parent / "prometheus_alerts_test.yml")],
    ):
        result = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr
