"""The gRPC floor: CPU per request of a grpc.aio servicer that answers at once.

The gateway's front door is grpc.aio on uvloop. This starts the same server
(same service registration, uvloop, default options) with a `ModelInfer` that
returns a prepared response, no NATS and no inferbus code, drives it with
`bench/loadgen.py` (the same client as every other figure), and prints the
server's CPU per answered request read from ``/proc/<pid>/stat``::

    uv run python bench/grpc_floor.py --load c64 r2000 --duration 6

``cN`` is a closed loop of N callers, ``rN`` an open loop at N req/s. What the
gateway spends above this floor is inferbus' own (round 7 in
``bench/findings.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_window import proc_cpu_s
from profile_stack import loadgen_argv

REPO = Path(__file__).resolve().parents[1]


def serve() -> None:
    """Run the bare servicer on a free loopback port; print the port on stdout."""
    import grpc
    import numpy as np
    import uvloop

    from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb
    from inferbus_proto.v2 import grpc_predict_v2_pb2_grpc as pbg

    answer = pb.ModelInferResponse(model_name="fraud", model_version="1")
    answer.outputs.add(name="probabilities", datatype="FP32", shape=[1, 2])
    answer.raw_output_contents.append(np.zeros((1, 2), np.float32).tobytes())
    metadata = pb.ModelMetadataResponse(name="fraud", versions=["1"], platform="onnxruntime_onnx")
    metadata.inputs.add(name="input", datatype="FP32", shape=[-1, 64])
    metadata.outputs.add(name="probabilities", datatype="FP32", shape=[-1, 2])

    class Bare(pbg.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            return answer

        async def ModelMetadata(self, request, context):
            return metadata

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=True)

    async def main() -> None:
        server = grpc.aio.server(options=json.loads(os.environ.get("GRPC_FLOOR_OPTIONS", "[]")))
        pbg.add_GRPCInferenceServiceServicer_to_server(Bare(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def measure(
    load: str, duration: float, warmup: float, options: Sequence[tuple[str, int | str]] = ()
) -> dict:
    """One loadgen run against a fresh bare server; req/s, busy cores, CPU µs/req.

    `options` are grpc.aio server options (``grpc.http2.bdp_probe`` and the like).
    """
    env = {**os.environ, "GRPC_FLOOR_OPTIONS": json.dumps(list(options))}
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    try:
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port:
            raise RuntimeError("the bare server did not start")
        client = subprocess.Popen(
            loadgen_argv(f"127.0.0.1:{port}", "fraud", load, duration, warmup),
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        # Sample inside the measured window: after warm-up (plus client start), before its end.
        time.sleep(warmup + 0.5)
        c0, t0 = proc_cpu_s(server.pid), time.monotonic()
        time.sleep(max(0.5, duration - 1.0))
        c1, t1 = proc_cpu_s(server.pid), time.monotonic()
        out, _ = client.communicate()
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        if not lines:
            raise RuntimeError(f"loadgen gave no result for {load}")
        rps = lines[-1]["throughput_rps"]
        busy = (c1 - c0) / (t1 - t0)
        return {
            "load": load,
            "rps": round(rps, 1),
            "busy_core": round(busy, 3),
            "cpu_us_per_req": round(1e6 * busy / rps, 1) if rps else None,
            "p50_ms": lines[-1]["latency_ms"]["p50"],
        }
    finally:
        server.kill()
        server.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load", nargs="+", default=["c64", "r2000"], help="cN or rN")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        help="a grpc.aio server option NAME=VALUE (integer values as integers); repeatable",
    )
    args = parser.parse_args(argv)
    options = []
    for item in args.option:
        name, _, value = item.partition("=")
        options.append((name, int(value) if value.lstrip("-").isdigit() else value))
    if args.serve:
        serve()
        return 0
    for load in args.load:
        row = measure(load, args.duration, args.warmup, options)
        print(json.dumps({**row, "options": dict(options)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
