"""Each model's latency objective on /metrics, so alerts compare p99 against it.

The objective is the stable version's ``slo_p99_ms`` (`ModelConfig`), or
`DEFAULT_SLO_S` when it sets none. It is read from the live catalog at scrape
time: a push or promotion changes it without anything on the request path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inferbus_common.catalog import Catalog

DEFAULT_SLO_S = 0.25
"""The objective of models whose config names none (the alert's default too)."""


class ModelSloCollector(Collector):
    """Exports ``inferbus_gateway_model_slo_seconds{model}`` for every routed model.

    Args:
        catalog: the gateway's live catalog.
    """

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per model that has a route."""
        family = GaugeMetricFamily(
            "inferbus_gateway_model_slo_seconds",
            "p99 latency objective of a model at the gateway (its stable version's "
            "slo_p99_ms, else 0.25 s); InferbusLatencyP99AboveSLO fires above it.",
            labels=["model"],
        )
        catalog = self._catalog
        for model, route in list(catalog.routes.items()):
            dv = catalog.versions.get((model, route.stable)) if route.stable else None
            slo_ms = dv.config.slo_p99_ms if dv is not None else None
            family.add_metric([model], slo_ms / 1000.0 if slo_ms else DEFAULT_SLO_S)
        yield family
