"""The inferbus stack as real processes for benchmarks.

The same stack the end-to-end tests use (`inferbus_testing.stack.LocalStack`:
nats-server with JetStream, registry, router, batcher, workers, gateway, each
``python -m <service>``), with logs and stores in a temp folder. Models are
pushed through the registry's gRPC API, exactly as users do.
"""

from __future__ import annotations

import re

import httpx

from inferbus_testing.stack import LocalStack


class BenchStack(LocalStack):
    """A running inferbus stack (`inferbus_testing.stack.LocalStack`) plus the
    batch-fill readings the benchmark reports."""

    def histogram_totals(self, service_prefix: str, metric: str) -> tuple[float, float]:
        """Sum and count of a Prometheus histogram over every process of a service.

        The difference of two readings gives the mean of what was observed in
        between: rows per micro-batch (batcher ``inferbus_batcher_batch_rows``)
        or rows per engine execution (worker ``inferbus_worker_batch_size``).

        Args:
            service_prefix: process name prefix (``"batcher"``, ``"worker"``).
            metric: histogram name without the ``_sum``/``_count`` suffix.
        """
        pattern = re.compile(rf"{re.escape(metric)}_(sum|count)(\{{[^}}]*\}})? ([0-9.eE+-]+)")
        total = count = 0.0
        for name, proc in self.procs.items():
            if not name.startswith(service_prefix):
                continue
            port = proc.ports["metrics"]
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
            for line in text.splitlines():
                m = pattern.match(line)
                if m:
                    if m.group(1) == "sum":
                        total += float(m.group(3))
                    else:
                        count += float(m.group(3))
        return total, count

    def batch_rows(self) -> tuple[float, float]:
        """Sum and count of rows per micro-batch cut by the batcher."""
        return self.histogram_totals("batcher", "inferbus_batcher_batch_rows")

    def engine_rows(self) -> tuple[float, float]:
        """Sum and count of rows per engine execution over all workers.

        Larger than `batch_rows` when workers merge waiting micro-batches.
        """
        return self.histogram_totals("worker", "inferbus_worker_batch_size")
