"""Triton's perf_analyzer, the real binary, unmodified, against the stack over gRPC and HTTP.

It reads the model's config (model configuration extension), sends random
inputs shaped from it, and reads server-side figures from the statistics
extension; a failure in either makes it exit non-zero. The binary comes
from ``scripts/install-perf-analyzer.sh`` (``scripts/test.sh`` runs it); where
it could not be installed the test is skipped and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# Fresher statistics than the default 2 s heartbeat: perf_analyzer finds the
# model version by the queue count growing within each (short) window.
STACK_ENV = {"INFERBUS_WORKER_HEARTBEAT_S": "0.5"}


def _bench_module():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import perf_analyzer
    finally:
        sys.path.remove(str(REPO / "bench"))
    return perf_analyzer


@pytest.fixture(scope="module")
def binary() -> Path:
    path = _bench_module().default_binary()
    if not path.exists():
        pytest.skip(
            f"perf_analyzer is not installed at {path}: run scripts/install-perf-analyzer.sh "
            "(needs PyPI and Debian's libb64-0d)"
        )
    return path


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_runs_and_reads_server_statistics(binary: Path, stack, protocol) -> None:
    pa = _bench_module()
    url = stack.grpc_url if protocol == "grpc" else stack.http_url
    row, _, output = pa.run_one(
        binary,
        protocol,
        url,
        "fraud",
        2,
        # Short windows, any stability, few trials: a smoke run, not a benchmark.
        ["-p", "2000", "--stability-percentage", "100", "--max-trials", "6"],
        timeout_s=120,
    )
    assert row.concurrency == 2
    assert row.throughput > 0
    assert 0 < row.p50_us <= row.p99_us
    # Server-side figures come from the statistics extension.
    assert "Server:" in output
    assert row.server_queue_us > 0
    assert row.server_compute_us > 0
