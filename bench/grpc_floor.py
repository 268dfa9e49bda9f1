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

How grpc.aio behaves when its event loop has other work (round 14): the
handler can wait like the gateway waits for its worker (``--delay-ms``), a task
can keep the loop busy in slices (``--busy-us``: runs that long, yields once,
again), and Triton's perf_analyzer can be the client (``--client
perf_analyzer``, from `scripts/install-perf-analyzer.sh`; ``cN`` loads only)::

    uv run python bench/grpc_floor.py --client perf_analyzer --load c16 \
        --delay-ms 0 5 --busy-us 0 300

Other ways to run the same servicer (round 15): ``--front thread`` puts it
behind a synchronous ``grpc.server`` (a thread pool) whose threads hand each
call to the event loop and wait; ``--register infer|none`` gives grpc.aio
fewer registered methods (the rest through its generic handler); ``--eager 1``
sets ``asyncio.eager_task_factory`` on the loop, which needs Python 3.12+ for
the server: ``--server-python`` names that interpreter (it needs grpcio,
uvloop, numpy and ``libs/proto``)::

    uv run python bench/grpc_floor.py --client perf_analyzer --load c16 c64 \
        --delay-ms 5 --busy-us 0 100 --front aio thread --register all none
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_window import proc_cpu_s

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

    from inferbus_proto.v2 import model_config_pb2 as mc

    delay_s = float(os.environ.get("GRPC_FLOOR_DELAY_S", "0"))
    busy_s = float(os.environ.get("GRPC_FLOOR_BUSY_S", "0"))
    config = mc.ModelConfig(name="fraud", platform="onnxruntime_onnx", max_batch_size=32)
    config.input.add(name="input", data_type=mc.TYPE_FP32, dims=[64])
    config.output.add(name="probabilities", data_type=mc.TYPE_FP32, dims=[2])

    class Bare(pbg.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            if delay_s:
                await asyncio.sleep(delay_s)
            return answer

        async def ModelConfig(self, request, context):
            return pb.ModelConfigResponse(config=config)

        async def ModelStatistics(self, request, context):
            stats = pb.ModelStatisticsResponse()
            stats.model_stats.add(name="fraud", version=request.version or "1")
            return stats

        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="bare", version="0")

        async def ModelMetadata(self, request, context):
            return metadata

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=True)

    async def busy() -> None:
        # Other work on the loop: `busy_s` of CPU, then one yield, and again.
        while True:
            until = time.perf_counter() + busy_s
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    if os.environ.get("GRPC_FLOOR_FRONT") == "thread":
        _serve_threaded(Bare(), busy_s, busy, pbg)
        return

    async def main() -> None:
        if os.environ.get("GRPC_FLOOR_EAGER") == "1":
            # Python 3.12+: a new task runs at once up to its first wait.
            factory = getattr(asyncio, "eager_task_factory", None)
            if factory is None:
                raise SystemExit(f"--eager 1 needs Python 3.12+ for the server, not {sys.version}")
            asyncio.get_running_loop().set_task_factory(factory)
        server = grpc.aio.server(options=json.loads(os.environ.get("GRPC_FLOOR_OPTIONS", "[]")))
        register = os.environ.get("GRPC_FLOOR_REGISTER", "all")
        if register != "all":
            add = server.add_registered_method_handlers

            def some(service, handlers):
                wanted = {"ModelInfer"} if register == "infer" else set()
                keep = {k: v for k, v in handlers.items() if k in wanted}
                if keep:
                    add(service, keep)

            setattr(server, "add_registered_method_handlers", some)  # noqa: B010
        pbg.add_GRPCInferenceServiceServicer_to_server(Bare(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        if busy_s:
            asyncio.get_running_loop().create_task(busy())
        print(port, flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def _serve_threaded(bare, busy_s: float, busy, pbg) -> None:
    """The same servicer behind a synchronous grpc.server (a thread pool), each call
    handed to the event loop in the main thread and waited for there: grpc's own
    thread accepts calls, so the loop's turns no longer pace the accepts."""
    import concurrent.futures
    import threading

    import grpc
    import uvloop

    loop = uvloop.new_event_loop()

    def on_loop(method):
        def call(self, request, context):
            return asyncio.run_coroutine_threadsafe(method(request, context), loop).result()

        return call

    methods = (
        "ModelInfer",
        "ModelConfig",
        "ModelStatistics",
        "ServerLive",
        "ServerMetadata",
        "ModelMetadata",
        "ServerReady",
        "ModelReady",
    )
    threaded = type(
        "Threaded",
        (pbg.GRPCInferenceServiceServicer,),
        {name: on_loop(getattr(bare, name)) for name in methods},
    )
    workers = int(os.environ.get("GRPC_FLOOR_THREADS", "128"))
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=workers),
        options=json.loads(os.environ.get("GRPC_FLOOR_OPTIONS", "[]")),
    )
    pbg.add_GRPCInferenceServiceServicer_to_server(threaded(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    if busy_s:
        loop.create_task(busy())
    print(port, flush=True)
    threading.Thread(target=server.wait_for_termination, daemon=True).start()
    loop.run_forever()


def measure(
    load: str,
    duration: float,
    warmup: float,
    options: Sequence[tuple[str, int | str]] = (),
    *,
    client: str = "loadgen",
    delay_s: float = 0.0,
    busy_s: float = 0.0,
    front: str = "aio",
    register: str = "all",
    eager: bool = False,
    python: str = "",
) -> dict:
    """One client run against a fresh bare server; req/s, busy cores, CPU µs/req.

    `options` are grpc.aio server options (``grpc.http2.bdp_probe`` and the like);
    `delay_s` the handler's wait, `busy_s` the busy task's slice (0: none); `front`,
    `register`, `eager` as ``--front``, ``--register``, ``--eager``; `python` the
    server's interpreter (empty: this one).
    """
    env = {
        **os.environ,
        "GRPC_FLOOR_OPTIONS": json.dumps(list(options)),
        "GRPC_FLOOR_DELAY_S": str(delay_s),
        "GRPC_FLOOR_BUSY_S": str(busy_s),
        "GRPC_FLOOR_FRONT": front,
        "GRPC_FLOOR_REGISTER": register,
        "GRPC_FLOOR_EAGER": "1" if eager else "0",
    }
    server = subprocess.Popen(
        [python or sys.executable, __file__, "--serve"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port:
            raise RuntimeError("the bare server did not start")
        if client == "perf_analyzer":
            return _measure_perf_analyzer(server.pid, f"127.0.0.1:{port}", load, duration)
        from profile_stack import loadgen_argv  # the stack's helpers: not needed to --serve

        loader = subprocess.Popen(
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
        out, _ = loader.communicate()
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


def _measure_perf_analyzer(pid: int, url: str, load: str, duration: float) -> dict:
    """perf_analyzer's stable window against the bare server at `pid` (``cN`` loads
    only, run by `bench/perf_analyzer.py`); CPU over its whole run."""
    if not load.startswith("c"):
        raise SystemExit(f"perf_analyzer runs closed loops only (cN), not {load!r}")
    from perf_analyzer import default_binary, run_one

    windows = ("-x", "1", "-p", str(int(duration * 1000)), "-s", "20", "--max-trials", "6")
    c0, t0 = proc_cpu_s(pid), time.monotonic()
    row, _, _ = run_one(default_binary(), "grpc", url, "fraud", int(load[1:]), windows)
    c1, t1 = proc_cpu_s(pid), time.monotonic()
    busy = (c1 - c0) / (t1 - t0)  # over the whole run (warm-up windows included)
    return {
        "load": load,
        "rps": round(row.throughput, 1),
        "busy_core": round(busy, 3),
        "p50_ms": round(row.p50_us / 1000.0, 3),
        "p99_ms": round(row.p99_us / 1000.0, 3),
    }


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
    parser.add_argument("--client", choices=["loadgen", "perf_analyzer"], default="loadgen")
    parser.add_argument(
        "--delay-ms", type=float, nargs="+", default=[0.0], help="the handler's wait(s)"
    )
    parser.add_argument(
        "--busy-us",
        type=float,
        nargs="+",
        default=[0.0],
        help="slice(s) of a task that keeps the loop busy (0: none)",
    )
    parser.add_argument(
        "--front",
        nargs="+",
        choices=["aio", "thread"],
        default=["aio"],
        help="grpc.aio on the loop, or a threaded grpc.server handing calls to the loop",
    )
    parser.add_argument(
        "--register",
        nargs="+",
        choices=["all", "infer", "none"],
        default=["all"],
        help="which methods grpc.aio gets as registered methods (the rest: generic handler)",
    )
    parser.add_argument(
        "--eager",
        type=int,
        nargs="+",
        choices=[0, 1],
        default=[0],
        help="1: the server's loop starts tasks eagerly (asyncio.eager_task_factory, Python 3.12+)",
    )
    parser.add_argument(
        "--server-python",
        default="",
        help="the interpreter that runs the bare server (default: this one); it needs grpcio, "
        "uvloop, numpy and inferbus_proto",
    )
    args = parser.parse_args(argv)
    if "thread" in args.front and (args.register != ["all"] or args.eager != [0]):
        parser.error("--register and --eager apply to the grpc.aio front only")
    options = []
    for item in args.option:
        name, _, value = item.partition("=")
        options.append((name, int(value) if value.lstrip("-").isdigit() else value))
    if args.serve:
        serve()
        return 0
    for load in args.load:
        for delay_ms in args.delay_ms:
            for busy_us, front, register, eager in itertools.product(
                args.busy_us, args.front, args.register, args.eager
            ):
                row = measure(
                    load,
                    args.duration,
                    args.warmup,
                    options,
                    client=args.client,
                    delay_s=delay_ms / 1000.0,
                    busy_s=busy_us / 1e6,
                    front=front,
                    register=register,
                    eager=bool(eager),
                    python=args.server_python,
                )
                extra = {
                    "client": args.client,
                    "front": front,
                    "register": register,
                    "eager": eager,
                    "delay_ms": delay_ms,
                    "busy_us": busy_us,
                }
                print(json.dumps({**row, **extra, "options": dict(options)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
