"""One small stack for the fuzz tests: nats-server, registry, router, batcher,
one worker and a gateway, serving the fraud model.

Package-scoped: every fuzz module shares it, and each one ends by checking
that every process is still alive and a good request is still answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from inferbus_testing.examples import make_fraud_model
from inferbus_testing.stack import LocalStack


class FuzzStack(LocalStack):
    """A `LocalStack` that can prove it still serves."""

    model_dir: Path

    def assert_serving(self) -> None:
        """Every process alive, and a good request answered correctly."""
        dead = {name: p.returncode for name, p in self.procs.items() if not p.running}
        assert not dead, f"services died: {dead}"
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            inp = grpcclient.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(np.ones((1, 64), np.float32))
            result = client.infer("fraud", [inp], client_timeout=10)
        finally:
            client.close()
        probs = result.as_numpy("probabilities")
        assert probs.shape == (1, 2)
        assert abs(float(probs.sum()) - 1.0) < 1e-4


@pytest.fixture(scope="package")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzStack]:
    """The stack, fraud model ready."""
    base = tmp_path_factory.mktemp("fuzz")
    stack = FuzzStack(base, workers=1)
    stack.model_dir = base / "fraud-model"
    make_fraud_model(stack.model_dir)
    with stack:
        stack.push(stack.model_dir, "fraud")
        stack.wait_model_ready("fraud")
        yield stack
