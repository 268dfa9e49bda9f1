"""Prometheus metrics of the registry."""

from __future__ import annotations

from prometheus_client import Counter

PUSHES = Counter(
    "inferbus_registry_pushes_total",
    "PushVersion calls by result (created, unchanged, invalid, conflict, error).",
    ["result"],
)
BYTES_STORED = Counter(
    "inferbus_registry_bytes_stored_total",
    "Bytes written to the object store by pushes.",
)
DOWNLOADS = Counter(
    "inferbus_registry_downloads_total",
    "DownloadFile calls by result (ok, not_found, error).",
    ["result"],
)
DOWNLOAD_BYTES = Counter(
    "inferbus_registry_download_bytes_total",
    "Bytes streamed by DownloadFile.",
)
