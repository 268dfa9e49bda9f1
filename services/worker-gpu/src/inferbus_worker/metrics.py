"""Prometheus metrics of the worker (process-wide, in the default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LABELS = ("model", "version")

BATCHES = Counter(
    "inferbus_worker_batches",
    "Micro-batches handled, by outcome (ok, expired, invalid, failed, retried, garbage).",
    [*_LABELS, "outcome"],
)
ROWS = Counter(
    "inferbus_worker_rows",
    "Rows the engine computed (expired requests' rows are not counted: they are not computed).",
    _LABELS,
)
BATCH_SIZE = Histogram(
    "inferbus_worker_batch_size",
    "Rows per engine execution.",
    _LABELS,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
QUEUE_SECONDS = Histogram(
    "inferbus_worker_queue_seconds",
    "Time from the batcher accepting a request to the engine starting on it.",
    _LABELS,
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
COMPUTE_SECONDS = Histogram(
    "inferbus_worker_compute_seconds",
    "Engine execution time per micro-batch.",
    _LABELS,
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)
REPLIES = Counter(
    "inferbus_worker_replies",
    "Replies sent to requests, by status (OK or a StatusCode name).",
    [*_LABELS, "status"],
)
REDELIVERIES = Counter(
    "inferbus_worker_redeliveries",
    "Micro-batches received more than once (num_delivered > 1).",
    _LABELS,
)
EXECUTION_SLOTS = Gauge(
    "inferbus_worker_execution_slots",
    "Engine execution slots (the config's instance_count) of a version this worker serves; "
    "utilisation = rate(inferbus_worker_compute_seconds_sum) / this.",
    _LABELS,
)
BUSY_SLOTS = Gauge(
    "inferbus_worker_busy_slots",
    "Execution slots running a micro-batch at scrape time.",
    _LABELS,
)
MODELS_LOADED = Gauge(
    "inferbus_worker_models_loaded",
    "Model versions this worker serves right now.",
)
LOAD_SECONDS = Histogram(
    "inferbus_worker_load_seconds",
    "Time to fetch, load and warm up a model version.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)

MERGED = Counter(
    "inferbus_worker_merged_batches",
    "Micro-batches that were joined with others into one engine execution.",
    _LABELS,
)

INLINE_RUNS = Counter(
    "inferbus_worker_inline_runs",
    "Engine executions run on the event loop instead of an engine thread "
    "(short runs; see INFERBUS_WORKER_INLINE_RUN_MAX_US).",
    _LABELS,
)

ARTIFACTS_REJECTED = Counter(
    "inferbus_worker_artifacts_rejected",
    "Versions refused before loading, by reason (signature, digest).",
    ["reason"],
)

PROCESSING_SECONDS = Histogram(
    "inferbus_worker_processing_seconds",
    "Pre/post-processing time per micro-batch, by stage (pre, post).",
    [*_LABELS, "stage"],
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)

CACHE_BYTES = Gauge(
    "inferbus_worker_cache_bytes",
    "Bytes of model versions in the local artifact cache (after the last fetch or eviction).",
)
CACHE_EVICTIONS = Counter(
    "inferbus_worker_cache_evictions_total",
    "Versions removed from the artifact cache to keep it under its size bound (LRU).",
)

SEQUENCES = Gauge(
    "inferbus_worker_sequences",
    "Sequences of a stateful version this worker holds (started, or with requests queued).",
    _LABELS,
)
SEQUENCES_FREED = Counter(
    "inferbus_worker_sequences_freed",
    "Sequences whose state the worker dropped, by why (end: after their end request; "
    "idle: no request for max_sequence_idle_us; stopped: the version or worker stopped).",
    [*_LABELS, "why"],
)
