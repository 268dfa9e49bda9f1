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
LIFECYCLE = Counter(
    "inferbus_registry_lifecycle_total",
    "Lifecycle changes by event (version_archived, version_unarchived, version_deleted, "
    "model_loaded, model_unloaded).",
    ["event"],
)
BYTES_DELETED = Counter(
    "inferbus_registry_bytes_deleted_total",
    "Bytes of artifact files removed from the object store by DeleteVersion.",
)
ROUTE_CHANGES = Counter(
    "inferbus_registry_route_changes_total",
    "Route revisions written, by writer (catalog, traffic, rollout).",
    ["writer"],
)
ROUTE_CONFLICTS = Counter(
    "inferbus_registry_route_conflicts_total",
    "SetTraffic calls refused because the route changed since the caller read it.",
)
ROLLOUT_EVENTS = Counter(
    "inferbus_registry_rollout_events_total",
    "Rollout transitions by event (rollout_started, rollout_canary_ready, rollout_step, "
    "rollout_paused, rollout_resumed, rollout_aborted, rollout_rolled_back, "
    "rollout_succeeded).",
    ["event"],
)
