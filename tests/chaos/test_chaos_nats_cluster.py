"""Losing a NATS node (issue #20): the platform on a three-node cluster with
clustered JetStream (work queue, audit stream and catalog buckets at 3
replicas), under steady closed-loop load. Two faults: kill -9 a node that
leads nothing on the data path, then the node that leads the work-queue stream
(a new leader is elected while batches flow). Each node is started again
after the hold. Every request gets exactly one answer, a correct one or an
explicit error before its deadline: none lost, none hung; the first correct
answer after each fault is measured. The same faults, held longer, make the
rows of docs/reliability.md ("NATS cluster: losing a node") through
`bench/reliability.py`; `-s` prints this test's rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferbus_testing.chaos import (
    CLUSTER_FAULTS,
    ClusterChaosStack,
    Shape,
    assert_nothing_lost,
    ready_stack,
    run_fault,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterChaosStack]:
    """Two workers, two gateways, Redis; NATS as three nodes; the fraud model ready."""
    base = tmp_path_factory.mktemp("cluster")
    with ready_stack(ClusterChaosStack, base) as stack:
        yield stack


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CLUSTER_FAULTS))
async def test_losing_a_nats_node_loses_nothing(
    cluster_stack: ClusterChaosStack, name: str
) -> None:
    assert all(cluster_stack.alive().values()), cluster_stack.alive()
    fault = CLUSTER_FAULTS[name]
    report = await run_fault(cluster_stack, fault, Shape.ci())
    assert_nothing_lost(report)
    # Served on the two nodes left, before the third is back.
    assert report.first_ok_after_fault_s is not None, report.samples
    assert report.first_ok_after_fault_s < fault.hold_s, report.row()
    assert all(report.alive.values()), report.alive
    assert report.recovered_s is not None, report.samples
