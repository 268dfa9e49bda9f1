"""One metrics view for a group of gateway processes on one host.

Every gateway process keeps its own metrics port (``/metrics``: that process
only). The processes of a group (``port_group`` ``first``/``join``) write
ports files to one directory; any of them serves ``/metrics/group``: the
``/metrics`` of every process whose ports file matches `pattern`, merged into
one exposition. Each sample carries a ``gateway_process`` label (the ports
file's name up to its first dot: ``gateway``, ``gateway-2`` ..., stable across
restarts), and each family appears once, with one HELP and TYPE line, as
Prometheus requires. A process that does not answer within the timeout is
left out and counted in ``inferbus_gateway_group_scrape_errors`` (a gauge of
this scrape), so a scrape never hangs on a dead member.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterable
from pathlib import Path

import prometheus_client
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

#: The label that tells the processes apart.
LABEL = "gateway_process"
#: How long one member's /metrics may take.
SCRAPE_TIMEOUT_S = 2.0


async def _fetch(host: str, port: int) -> str:
    """GET http://host:port/metrics (HTTP/1.0, the body until the server closes)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
        raise OSError(f"{host}:{port}/metrics answered {head[:40]!r}")
    return body.decode()


def members(pattern: str) -> dict[str, int]:
    """Process name → metrics port, from the ports files matching `pattern` (a glob)."""
    path = Path(pattern)
    found = {}
    for file in sorted(path.parent.glob(path.name)):
        try:
            data = json.loads(file.read_text())
            found[file.name.split(".", 1)[0]] = int(data["metrics"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not a ports file
    return found


class _Merged(Collector):
    """The families of every member, each once, samples labelled by member."""

    def __init__(self, texts: dict[str, str], errors: int) -> None:
        self.texts = texts
        self.errors = errors

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for s in family.samples:
                    labels = {**s.labels, LABEL: name}
                    merged.samples.append(s._replace(labels=labels))
        yield from families.values()
        errors = GaugeMetricFamily(
            "inferbus_gateway_group_scrape_errors",
            "Gateway processes of the group whose /metrics did not answer in this scrape.",
        )
        errors.add_metric([], self.errors)
        yield errors


async def group_exposition(pattern: str, host: str = "127.0.0.1") -> bytes:
    """The merged exposition of every member found by `pattern`."""
    found = members(pattern)
    names = list(found)
    results = await asyncio.gather(
        *(asyncio.wait_for(_fetch(host, found[n]), SCRAPE_TIMEOUT_S) for n in names),
        return_exceptions=True,
    )
    texts = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, str)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts, len(names) - len(texts)))
    return prometheus_client.generate_latest(registry)


def group_route(pattern: str, host: str = "127.0.0.1") -> Route:
    """``/metrics/group`` for the ops app (see the module)."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"

    async def endpoint(_: Request) -> Response:
        body = await group_exposition(pattern, host)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return Route("/metrics/group", endpoint)


def default_pattern(ports_file: Path | None) -> str | None:
    """``<dir of the ports file>/gateway*.json`` (None without a ports file)."""
    if ports_file is None:
        return None
    return os.fspath(ports_file.parent / "gateway*.json")
