"""Prometheus metrics of the batcher (process-wide, in the default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TIME_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

QUEUE_DEPTH = Gauge(
    "inferbus_batcher_queue_depth",
    "Requests waiting in the batcher's queue of a model version.",
    ["model", "version"],
)
BATCH_ROWS = Histogram(
    "inferbus_batcher_batch_rows",
    "Rows (batch-axis size) of the micro-batches published.",
    ["model", "version"],
    buckets=_ROW_BUCKETS,
)
BATCH_REQUESTS = Histogram(
    "inferbus_batcher_batch_requests",
    "Requests per micro-batch published.",
    ["model", "version"],
    buckets=_ROW_BUCKETS,
)
QUEUE_TIME = Histogram(
    "inferbus_batcher_queue_time_seconds",
    "Time a request waited in the batcher before its batch was formed.",
    ["model", "version"],
    buckets=_TIME_BUCKETS,
)
REJECTIONS = Counter(
    "inferbus_batcher_rejections_total",
    "Requests the batcher answered with an error, by reason.",
    ["model", "version", "reason"],
)
BATCHES_PUBLISHED = Counter(
    "inferbus_batcher_batches_published_total",
    "Micro-batches JetStream acknowledged.",
    ["model", "version"],
)
IDLE_DISPATCHES = Counter(
    "inferbus_batcher_idle_dispatches_total",
    "Times a queue was dispatched at once because a worker said it was idle.",
)
PUBLISHES_OUTSTANDING = Gauge(
    "inferbus_batcher_publishes_outstanding",
    "Micro-batch publishes waiting for their JetStream acknowledgement.",
)


class QueueMetrics:
    """The labelled metric children of one model version, looked up once.

    Args:
        model: model name label.
        version: version label.
    """

    __slots__ = (
        "_depth",
        "_model",
        "_version",
        "batch_requests",
        "batch_rows",
        "depth",
        "published",
        "queue_time",
    )

    def __init__(self, model: str, version: str) -> None:
        self._model = model
        self._version = version
        self.depth = QUEUE_DEPTH.labels(model, version)
        self.batch_rows = BATCH_ROWS.labels(model, version)
        self.batch_requests = BATCH_REQUESTS.labels(model, version)
        self.queue_time = QUEUE_TIME.labels(model, version)
        self.published = BATCHES_PUBLISHED.labels(model, version)
        self._depth: int | None = None

    def set_depth(self, depth: int) -> None:
        """Show the queue's depth; the gauge is only written when it changed
        (the batcher reports it after every arrival and dispatch)."""
        if depth != self._depth:
            self._depth = depth
            self.depth.set(depth)

    def rejected(self, reason: str, count: int = 1) -> None:
        """Count `count` requests answered with an error for `reason`."""
        REJECTIONS.labels(self._model, self._version, reason).inc(count)
