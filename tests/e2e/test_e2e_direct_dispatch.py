"""Direct dispatch through the whole stack (``INFERBUS_GATEWAY_DIRECT_DISPATCH``).

With the setting on (the default; set explicitly here), a request on a plain
route (only a stable version) goes from the gateway straight to the batchers
and never reaches the router; so does a request that pins a version or an
alias: the gateway resolves the pin with the router's own rule
(`inferbus_common.resolver`), and without a shadow copy to send the router has
nothing left to do. A pin that names nothing is NOT_FOUND from the gateway.
Answers are the same either way.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

STACK_ENV = {"INFERBUS_GATEWAY_DIRECT_DISPATCH": "true"}


def _routed(stack) -> float:
    return sum(
        v
        for k, v in stack.metrics(stack.router).items()
        if k.startswith("inferbus_router_requests_total{")
    )


def _infer(client, x: np.ndarray, version: str = "") -> grpcclient.InferResult:
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("fraud", [inp], model_version=version)


def test_plain_route_and_pins_skip_the_router(stack) -> None:
    session = ort.InferenceSession(
        str(stack.model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    expected = session.run(["probabilities"], {"input": x})[0]
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        before = _routed(stack)
        for _ in range(5):
            result = _infer(client, x)
            np.testing.assert_allclose(
                result.as_numpy("probabilities"), expected, rtol=1e-5, atol=1e-6
            )
            assert result.get_response().model_version == "1"
        assert _routed(stack) == before  # none of the five went through the router

        for pin in ("1", "stable"):
            pinned = _infer(client, x, version=pin)
            np.testing.assert_allclose(
                pinned.as_numpy("probabilities"), expected, rtol=1e-5, atol=1e-6
            )
            assert pinned.get_response().model_version == "1"
        with pytest.raises(InferenceServerException) as err:
            _infer(client, x, version="9")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert "model 'fraud' has no version '9' and no alias '9'" in err.value.message()
        assert _routed(stack) == before
    finally:
        client.close()
