"""The whole stack as real processes (`inferbus_testing.stack.LocalStack`):
nats-server, registry, router, batcher, two workers and a gateway, with the
example fraud model pushed and ready.

Module-scoped: starting it costs a few seconds, so each test module that uses
it shares one stack. A module may set ``STACK_ENV`` (environment for every
service, e.g. a short worker ack wait) and ``STACK_REDIS = True`` (a real
redis-server for the gateway).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inferbus_testing.examples import make_fraud_model
from inferbus_testing.stack import LocalStack


class Stack(LocalStack):
    """A `LocalStack` that also knows the model directory it serves."""

    model_dir: Path


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A full stack serving the fraud model (two workers)."""
    base = tmp_path_factory.mktemp("stack")
    st = Stack(
        base,
        workers=2,
        env=dict(getattr(request.module, "STACK_ENV", {})),
        with_redis=getattr(request.module, "STACK_REDIS", False),
    )
    st.model_dir = make_fraud_model(base / "fraud-model")
    with st:
        st.push(st.model_dir, "fraud")
        st.wait_model_ready("fraud")
        yield st
