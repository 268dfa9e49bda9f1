"""One `ChaosStack` for the package: two workers, two gateways and the gRPC edge in
front of them, Redis with a limit, the registry on S3; the fraud model and a slow
model for overload.

Package-scoped: the stack takes ~15 s to start on two cores, and the fault
matrix and the overload tests can share it (each fault is healed before the
next starts, and every test checks first that the stack serves).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferbus_testing.chaos import ChaosStack, ready_stack


@pytest.fixture(scope="package")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    """The whole platform, the edge too, both models ready, a (high) cluster limit
    set in Redis."""
    base = tmp_path_factory.mktemp("chaos")
    with ready_stack(ChaosStack, base, with_slow=True, edge=True) as stack:
        yield stack
