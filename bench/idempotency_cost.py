"""CPU per request of the gateway's idempotency cache (`IdempotencyCache.run`).

A loop of requests that carry an id (all misses, the common case: each id
new) through `run` with a compute that answers at once, each answer with one
small output that is a view into a larger buffer (as a reply bundle's is). Prints µs per
request by input size, best of `--repeat`.

``--module PATH`` loads another implementation of the cache from a file
instead (for an A/B against an earlier revision, e.g. ``git show
<rev>:services/gateway/src/inferbus_gateway/idempotency.py > /tmp/old.py``).

    uv run python bench/idempotency_cost.py [--module /tmp/old.py]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
from types import ModuleType

import numpy as np
from prometheus_client import REGISTRY

from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_gateway.canonical import InferRequest, InferResponse


def _load(path: str) -> ModuleType:
    if not path:
        import inferbus_gateway.idempotency as current

        return current
    # The other file registers the same metric names: give it a registry of its own.
    spec = importlib.util.spec_from_file_location("idempotency_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    register = REGISTRY.register
    REGISTRY.register = lambda collector: None  # type: ignore[method-assign]
    try:
        spec.loader.exec_module(module)
    finally:
        REGISTRY.register = register  # type: ignore[method-assign]
    return module


async def _per_request_us(module: ModuleType, nbytes: int, n: int) -> float:
    cache = module.IdempotencyCache(window_s=30)
    bundle = memoryview(np.zeros(64 * 8, np.uint8))

    async def compute() -> InferResponse:
        # A fresh answer per request, as the gateway builds one from each reply.
        return InferResponse("m", "1", "r", [Tensor("y", "FP32", (1, 2), bundle[:8])])

    x = np.ones((1, nbytes // 4), np.float32)
    requests = [InferRequest("m", "", f"id-{i}", [tensor_from_numpy("x", x)]) for i in range(n)]
    t0 = time.perf_counter()
    for request in requests:
        await cache.run(request, compute)
    return (time.perf_counter() - t0) / n * 1e6


async def _main(args: argparse.Namespace) -> None:
    module = _load(args.module)
    for nbytes in (256, 64 << 10, 1 << 20):
        n = args.requests if nbytes < (1 << 20) else max(1, args.requests // 16)
        best = min([await _per_request_us(module, nbytes, n) for _ in range(args.repeat)])
        print(f"input {nbytes:>8} B: {best:8.1f} µs per request")


def main() -> None:
    """Parse arguments and run the loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="", help="another idempotency.py to measure")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
