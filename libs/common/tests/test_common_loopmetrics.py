"""Loop-thread metrics expose exactly what prometheus_client's own would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferbus_common.loopmetrics import LoopCounter, LoopGauge, LoopHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.1, 1.0)


def _lines(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if line and "_created" not in line)


def test_histogram_matches_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a = LoopHistogram("t_seconds", "doc", ["model", "stage"], buckets=BUCKETS, registry=ours)
    b = Histogram("t_seconds", "doc", ["model", "stage"], buckets=BUCKETS, registry=theirs)
    values = [0.0, 0.001, 0.0011, 0.005, 0.05, 0.5, 1.0, 3.0, 7.5e-4]
    for v in values:
        for h in (a, b):
            h.labels("m", "queue").observe(v)
            h.labels("m2", "compute").observe(v * 2)
    assert _lines(ours) == _lines(theirs)


def test_counter_and_gauge_match_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = LoopCounter("req_total", "doc", ["status"], registry=ours)
    c2 = Counter("req_total", "doc", ["status"], registry=theirs)
    plain1 = LoopCounter("dup_total", "doc", registry=ours)
    plain2 = Counter("dup_total", "doc", registry=theirs)
    g1 = LoopGauge("inflight", "doc", registry=ours)
    g2 = Gauge("inflight", "doc", registry=theirs)
    for c in (c1, c2):
        c.labels("OK").inc()
        c.labels("OK").inc(2)
        c.labels("INTERNAL").inc()
    for c in (plain1, plain2):
        c.inc(5)
    for g in (g1, g2):
        g.inc()
        g.inc()
        g.dec()
    assert _lines(ours) == _lines(theirs)
    assert plain1.value == 5


def test_labels_are_checked_and_children_removable() -> None:
    reg = CollectorRegistry()
    h = LoopHistogram("x_seconds", "doc", ["a"], registry=reg)
    with pytest.raises(ValueError, match="expected labels"):
        h.labels("a", "b")
    h.labels("one").observe(1.0)
    h.remove("one")
    assert "x_seconds_count{" not in generate_latest(reg).decode()
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("y_seconds", "doc", buckets=(1.0, 0.5), registry=reg)
