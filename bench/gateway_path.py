"""CPU of the gateway's own Python per `ModelInfer`, with gRPC and NATS left out.

Calls the real `GRPCInferenceServicer.ModelInfer` of `inferbus_gateway` with a
prepared protobuf request, in a loop on uvloop, and prints CPU µs per call.
Only the edges are replaced: the catalog holds one ready `fraud` version, the
dispatcher answers at once with a prepared reply frame, and the NATS client
drops the audit messages it is given. Everything in between (context,
validation, admission, conversion both ways, reply decoding, metrics,
access-log line, audit record batching) is the code the gateway runs::

    uv run python bench/gateway_path.py [--calls 20000] [--no-access-log] [--no-audit] [--profile]

What this leaves out is measured by `bench/grpc_floor.py` (the grpc.aio server
itself); the sum of the two against the gateway's CPU per request under load
(`bench/profile_stack.py`) is the NATS client and asyncio scheduling.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import uvloop

from inferbus_common.catalog import Catalog, DeployedVersion, Route
from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.logs import setup_logging
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import encode_tensors
from inferbus_common.subjects import Subjects
from inferbus_gateway.__main__ import build_pipeline
from inferbus_gateway.dispatch.dispatcher import Reply
from inferbus_gateway.grpc_api.servicer import GRPCInferenceServicer
from inferbus_gateway.pipeline import (
    Dispatch,
    InferHandler,
)
from inferbus_gateway.service import InferenceService
from inferbus_gateway.settings import GatewaySettings
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

CONFIG = ModelConfig(
    name="fraud",
    max_batch_size=32,
    inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
    outputs=[
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "label", "datatype": "INT64", "shape": [-1]},
    ],
    batching={"max_queue_delay_us": 500},
)
DIGEST = "d" * 64


class OneModelCatalog(Catalog):
    """The live catalog's lookups over one ready, stable version (no bus to watch)."""

    def __init__(self) -> None:
        self.routes = {"fraud": Route(model="fraud", stable="1", versions=["1"])}
        self.versions = {
            ("fraud", "1"): DeployedVersion(
                model="fraud", version="1", config=CONFIG, digest=DIGEST
            )
        }

    def version_state(self, model: str, version: str) -> str:
        return "ready"

    def is_ready(self, model: str, version: str) -> bool:
        return True


class InstantDispatcher:
    """Answers every call at once with the reply a worker would send."""

    def __init__(self) -> None:
        self._frame = encode_tensors(
            [
                tensor_from_numpy("probabilities", np.zeros((1, 2), np.float32)),
                tensor_from_numpy("label", np.zeros((1,), np.int64)),
            ]
        )

    async def call(self, envelope: Envelope, tensors: list[Tensor], **_: Any) -> Reply:
        return Reply(
            "",
            version="1",
            digest=DIGEST,
            timings_ms={"queue": 0.5, "compute": 0.1},
            frame=self._frame,
        )


class DroppingClient:
    """The NATS client surface the service publishes audit batches through."""

    is_connected = True

    async def publish(self, *args: Any, **kwargs: Any) -> None:
        return None


class Context:
    """A grpc.aio servicer context with no deadline and plain metadata."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("user-agent", "grpc-python/1.7"),)

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, metadata: object) -> None:
        return None

    async def abort(self, code: object, message: str) -> None:
        raise RuntimeError(f"{code}: {message}")


async def run(calls: int, access_log: bool, audit: bool, profile: bool) -> float:
    """CPU µs per `ModelInfer` over `calls` calls after 2,000 warm-up calls."""
    catalog = OneModelCatalog()
    handler = InferHandler(
        catalog,  # type: ignore[arg-type]
        Dispatch(catalog, InstantDispatcher()),  # type: ignore[arg-type]
        default_timeout_s=30.0,
    )
    client = DroppingClient()
    # The steps `__main__.build_pipeline` assembles, without admission, observers
    # or shared memory.
    settings = GatewaySettings(  # type: ignore[call-arg]
        _env_file=None, audit_enabled=audit, audit_batch_ms=20.0, idempotency_window_s=30.0
    )
    steps = build_pipeline(
        settings,
        handler,
        nc=client,  # type: ignore[arg-type]
        subjects=Subjects("ib"),
        instance="gw-bench",
        admission=None,
        observers=[],
        shared_memory=None,
    )
    service = InferenceService(
        client,  # type: ignore[arg-type]
        catalog,  # type: ignore[arg-type]
        handler,
        server_name="bench",
        version="1",
        steps=steps,
    )
    service.catalog_loaded = True
    servicer = GRPCInferenceServicer(service, access_log=access_log)
    request = pb.ModelInferRequest(
        model_name="fraud",
        inputs=[
            pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, 64])
        ],
        raw_input_contents=[np.random.default_rng(0).random((1, 64), np.float32).tobytes()],
    )
    context = Context()
    for _ in range(2000):
        await servicer.ModelInfer(request, context)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    t0 = time.process_time()
    for _ in range(calls):
        await servicer.ModelInfer(request, context)
    spent = time.process_time() - t0
    if profiler:
        profiler.disable()
        top = int(os.environ.get("INFERBUS_BENCH_TOP", "25"))
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    return spent / calls * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--no-audit", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile, top 25 by self time")
    args = parser.parse_args(argv)
    setup_logging("gateway", "INFO", "json")
    # The access log is a real JSON line per call; write it where it costs a write, not a tty.
    logging.getLogger().handlers[0].stream = open(os.devnull, "w")
    us = uvloop.run(run(args.calls, not args.no_access_log, not args.no_audit, args.profile))
    print(
        f"{us:.1f} µs CPU per ModelInfer (access log {'off' if args.no_access_log else 'on'}, "
        f"audit {'off' if args.no_audit else 'on'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
