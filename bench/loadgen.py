"""KServe V2 load generator for inferbus and its peers (Triton, MLServer).

Speaks the Open Inference Protocol over gRPC (Triton's own
``tritonclient.grpc.aio`` client, so the same client measures every server) or
REST (``httpx``, binary tensor extension). Two load models:

* closed loop (``--concurrency N``): N callers, each sends its next request as
  soon as the previous one is answered;
* open loop (``--rate R``): requests start at a fixed rate, Poisson or evenly
  spaced (``--arrival``), whatever the answers do (``--max-outstanding`` caps
  requests in flight; arrivals over the cap count as ``CLIENT_OVERLOAD``).

A run lasts ``--duration`` seconds or ``--requests`` measured requests,
whichever comes first, after ``--warmup`` seconds whose requests are not
counted. It prints and appends one JSON line to ``--out``: throughput (req/s,
rows/s), latency percentiles, errors by status, and for inferbus the stage
breakdown the gateway returns in ``ModelInferResponse.parameters``
(``inferbus_queue_us``, ``inferbus_compute_us``, ``inferbus_gateway_us``,
``inferbus_total_us``).

Usage::

    uv run python bench/loadgen.py --url 127.0.0.1:8001 --model fraud --concurrency 64
    uv run python bench/loadgen.py --protocol rest --url 127.0.0.1:8000 --model fraud \
        --rate 500 --arrival poisson --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from record import RESULTS_DIR, append_result, machine_info

MARK = "loadgen: "
"""Prefix of the ``--marks`` lines on stderr."""
STAGES = ("queue", "compute", "gateway", "total")
"""Stage timings inferbus puts into the response parameters as ``inferbus_<stage>_us``."""

_NP_DTYPES = {
    "FP32": np.float32,
    "FP64": np.float64,
    "FP16": np.float16,
    "INT64": np.int64,
    "INT32": np.int32,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
}


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One model input as the server's metadata describes it."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def make(self, rows: int, rng: np.random.Generator) -> np.ndarray:
        """A random tensor for this input with `rows` rows (``-1`` dims become `rows`)."""
        shape = tuple(rows if d < 0 else d for d in self.shape)
        dtype = _NP_DTYPES[self.datatype]
        return rng.standard_normal(shape).astype(dtype)


@dataclass(slots=True)
class Outcome:
    """What one request returned."""

    start: float
    latency_s: float
    status: str
    stages_us: dict[str, int] = field(default_factory=dict)


class RequestError(Exception):
    """A request failed; `status` is the gRPC status name or ``HTTP_<code>``."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


SendFn = Callable[[], Awaitable[dict[str, int]]]


# --------------------------------------------------------------------- clients


class GrpcTarget:
    """KServe V2 over gRPC with ``tritonclient.grpc.aio``."""

    def __init__(
        self, url: str, model: str, version: str, timeout_s: float, channels: int = 1
    ) -> None:
        import tritonclient.grpc.aio as grpcclient

        self._mod = grpcclient
        # Each channel its own subchannel pool, hence its own HTTP/2 connection
        # (equal channels otherwise share one): the kernel spreads connections,
        # not requests, over gateway processes sharing a port.
        args = [("grpc.use_local_subchannel_pool", 1)] if channels > 1 else None
        self._clients = [
            grpcclient.InferenceServerClient(url, channel_args=args) for _ in range(channels)
        ]
        self._next = 0
        self._client = self._clients[0]
        self._model = model
        self._version = version
        self._timeout_s = timeout_s
        self._inputs: list[Any] = []

    async def metadata(self) -> list[InputSpec]:
        """Inputs from ModelMetadata."""
        md = await self._client.get_model_metadata(self._model, self._version)
        return [InputSpec(i.name, i.datatype, tuple(int(d) for d in i.shape)) for i in md.inputs]

    def prepare(self, specs: Sequence[InputSpec], arrays: Sequence[np.ndarray]) -> None:
        """Build the request inputs once; every request sends the same bytes."""
        self._inputs = []
        for spec, arr in zip(specs, arrays, strict=True):
            inp = self._mod.InferInput(spec.name, list(arr.shape), spec.datatype)
            inp.set_data_from_numpy(arr)
            self._inputs.append(inp)

    async def send(self) -> dict[str, int]:
        """One ModelInfer; returns the inferbus stage timings found in the parameters."""
        from tritonclient.utils import InferenceServerException

        client = self._clients[self._next]
        self._next = (self._next + 1) % len(self._clients)
        try:
            result = await client.infer(
                self._model,
                self._inputs,
                model_version=self._version,
                client_timeout=self._timeout_s,
            )
        except InferenceServerException as exc:
            raise RequestError(_grpc_status_name(exc.status()), exc.message() or "") from None
        params = result.get_response().parameters
        stages: dict[str, int] = {}
        for stage in STAGES:
            key = f"inferbus_{stage}_us"
            if key in params:
                stages[stage] = params[key].int64_param
        return stages

    async def close(self) -> None:
        """Close the channels."""
        for client in self._clients:
            await client.close()


def _grpc_status_name(status: str | None) -> str:
    # tritonclient reports "StatusCode.UNAVAILABLE"; keep the bare name.
    if not status:
        return "UNKNOWN"
    return status.rsplit(".", 1)[-1]


class RestTarget:
    """KServe V2 over HTTP/1.1 with ``httpx``; inputs use the binary tensor extension."""

    def __init__(
        self, url: str, model: str, version: str, timeout_s: float, concurrency: int
    ) -> None:
        import httpx

        base = url if url.startswith("http") else f"http://{url}"
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client = httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits)
        self._path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        self._body = b""
        self._headers: dict[str, str] = {}

    async def metadata(self) -> list[InputSpec]:
        """Inputs from the model metadata endpoint."""
        resp = await self._client.get(self._path)
        resp.raise_for_status()
        doc = resp.json()
        return [
            InputSpec(i["name"], i["datatype"], tuple(int(d) for d in i["shape"]))
            for i in doc["inputs"]
        ]

    def prepare(self, specs: Sequence[InputSpec], arrays: Sequence[np.ndarray]) -> None:
        """Build the binary request body once."""
        header = {
            "inputs": [
                {
                    "name": spec.name,
                    "shape": list(arr.shape),
                    "datatype": spec.datatype,
                    "parameters": {"binary_data_size": arr.nbytes},
                }
                for spec, arr in zip(specs, arrays, strict=True)
            ]
        }
        head = json.dumps(header).encode()
        self._body = head + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        self._headers = {
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        }

    async def send(self) -> dict[str, int]:
        """One infer POST; REST answers carry no stage timings."""
        import httpx

        try:
            resp = await self._client.post(
                self._path + "/infer", content=self._body, headers=self._headers
            )
        except httpx.TimeoutException:
            raise RequestError("DEADLINE_EXCEEDED", "client timeout") from None
        except httpx.TransportError as exc:
            raise RequestError("UNAVAILABLE", str(exc)) from None
        if resp.status_code != 200:
            raise RequestError(f"HTTP_{resp.status_code}", resp.text[:200])
        return {}

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


# ----------------------------------------------------------------------- load


async def _timed(send: SendFn) -> Outcome:
    start = time.perf_counter()
    try:
        stages = await send()
    except RequestError as exc:
        return Outcome(start, time.perf_counter() - start, exc.status)
    return Outcome(start, time.perf_counter() - start, "OK", stages)


async def closed_loop(
    send: SendFn, concurrency: int, t_measure: float, t_end: float, max_requests: int | None
) -> list[Outcome]:
    """Run `concurrency` callers back to back until `t_end` or `max_requests` measured.

    Args:
        send: sends one request.
        concurrency: number of callers.
        t_measure: perf_counter time when warm-up ends.
        t_end: perf_counter time when no new request starts.
        max_requests: stop after this many measured requests (None: no bound).

    Returns:
        Every outcome, warm-up included (the caller filters on `Outcome.start`).
    """
    outcomes: list[Outcome] = []
    measured = 0

    async def caller() -> None:
        nonlocal measured
        while time.perf_counter() < t_end:
            now = time.perf_counter()
            if now >= t_measure:
                if max_requests is not None and measured >= max_requests:
                    return
                measured += 1
            outcomes.append(await _timed(send))

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(caller())
    return outcomes


async def open_loop(
    send: SendFn,
    rate: float,
    arrival: str,
    t_measure: float,
    t_end: float,
    max_requests: int | None,
    max_outstanding: int,
    seed: int,
) -> list[Outcome]:
    """Start requests at `rate` per second (Poisson or fixed gaps) until `t_end`.

    Arrivals while `max_outstanding` requests are in flight are not sent and
    are recorded as ``CLIENT_OVERLOAD`` with zero latency.

    Returns:
        Every outcome, warm-up included.
    """
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    in_flight = 0
    measured = 0

    async def one() -> None:
        nonlocal in_flight
        try:
            outcomes.append(await _timed(send))
        finally:
            in_flight -= 1

    async with asyncio.TaskGroup() as tg:
        next_at = time.perf_counter()
        while True:
            next_at += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
            if next_at >= t_end:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if next_at >= t_measure:
                if max_requests is not None and measured >= max_requests:
                    break
                measured += 1
            if in_flight >= max_outstanding:
                outcomes.append(Outcome(next_at, 0.0, "CLIENT_OVERLOAD"))
                continue
            in_flight += 1
            tg.create_task(one())
    return outcomes


# -------------------------------------------------------------------- summary


def _pct_ms(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000.0, 3) if values.size else None


def summarize(outcomes: Sequence[Outcome], t_measure: float, rows: int) -> dict[str, Any]:
    """Throughput, latency percentiles, errors and stage breakdown of the measured window.

    Args:
        outcomes: every outcome of the run.
        t_measure: perf_counter time when warm-up ended; earlier starts are dropped.
        rows: rows per request.

    Returns:
        The result fields of one JSON line.
    """
    measured = [o for o in outcomes if o.start >= t_measure]
    ok = [o for o in measured if o.status == "OK"]
    errors = Counter(o.status for o in measured if o.status != "OK")
    if measured:
        window = max(o.start + o.latency_s for o in measured) - t_measure
    else:
        window = 0.0
    lat = np.array([o.latency_s for o in ok], dtype=np.float64)
    rps = len(ok) / window if window > 0 else 0.0
    stage_values: dict[str, list[int]] = defaultdict(list)
    for o in ok:
        for stage, us in o.stages_us.items():
            stage_values[stage].append(us)
    stages = {
        stage: {
            "mean_us": round(float(np.mean(v)), 1),
            "p50_us": round(float(np.percentile(v, 50)), 1),
            "p99_us": round(float(np.percentile(v, 99)), 1),
        }
        for stage, v in stage_values.items()
        if v
    }
    return {
        "requests": len(measured),
        "ok": len(ok),
        "errors": dict(errors),
        "window_s": round(window, 3),
        "throughput_rps": round(rps, 1),
        "throughput_rows_s": round(rps * rows, 1),
        "latency_ms": {
            "mean": round(float(lat.mean()) * 1000.0, 3) if lat.size else None,
            "p50": _pct_ms(lat, 50),
            "p90": _pct_ms(lat, 90),
            "p99": _pct_ms(lat, 99),
            "max": round(float(lat.max()) * 1000.0, 3) if lat.size else None,
        },
        "stages": stages,
    }


# ------------------------------------------------------------------------ cli


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server address, host:port")
    p.add_argument("--protocol", choices=["grpc", "rest"], default="grpc")
    p.add_argument("--model", required=True)
    p.add_argument("--model-version", default="", help="pin a version (default: server's)")
    p.add_argument("--target", default="inferbus", help="label of the server under test")
    p.add_argument(
        "--channels",
        type=int,
        default=1,
        help="gRPC channels (connections) the callers take turns on (1)",
    )
    p.add_argument("--rows", type=int, default=1, help="rows (batch size) per request")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop with N callers (default 1)")
    mode.add_argument("--rate", type=float, help="open loop at R requests/s")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--max-outstanding", type=int, default=1024, help="open-loop in-flight cap")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    p.add_argument("--requests", type=int, default=None, help="stop after N measured requests")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds not measured")
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request (s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label", default="", help="free-text tag stored with the result")
    p.add_argument(
        "--marks",
        action="store_true",
        help=f"print {MARK}measuring / {MARK}measured on stderr when the warm-up ends and"
        " when the last request is answered (run_all.py reads server CPU there)",
    )
    p.add_argument(
        "--out", type=Path, default=RESULTS_DIR / "loadgen.jsonl", help="JSONL file to append to"
    )
    args = p.parse_args(argv)
    if args.concurrency is None and args.rate is None:
        args.concurrency = 1
    if args.rows < 1 or (args.concurrency is not None and args.concurrency < 1):
        p.error("--rows and --concurrency must be at least 1")
    if args.rate is not None and args.rate <= 0:
        p.error("--rate must be positive")
    return args


async def _mark_at(t: float) -> None:
    """Print the ``measuring`` mark at perf_counter time `t` (the end of the warm-up)."""
    await asyncio.sleep(max(0.0, t - time.perf_counter()))
    print(f"{MARK}measuring", file=sys.stderr, flush=True)


async def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run one load test and return its JSON record."""
    width = args.concurrency or args.max_outstanding
    if args.protocol == "grpc":
        target: GrpcTarget | RestTarget = GrpcTarget(
            args.url, args.model, args.model_version, args.timeout, args.channels
        )
    else:
        target = RestTarget(args.url, args.model, args.model_version, args.timeout, width)
    try:
        specs = await target.metadata()
        rng = np.random.default_rng(args.seed)
        target.prepare(specs, [s.make(args.rows, rng) for s in specs])
        t0 = time.perf_counter()
        t_measure = t0 + args.warmup
        t_end = t_measure + args.duration
        marker = asyncio.create_task(_mark_at(t_measure)) if args.marks else None
        try:
            if args.concurrency is not None:
                outcomes = await closed_loop(
                    target.send, args.concurrency, t_measure, t_end, args.requests
                )
            else:
                outcomes = await open_loop(
                    target.send,
                    args.rate,
                    args.arrival,
                    t_measure,
                    t_end,
                    args.requests,
                    args.max_outstanding,
                    args.seed,
                )
        finally:
            if marker is not None:
                marker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await marker
        if args.marks:
            print(f"{MARK}measured", file=sys.stderr, flush=True)
    finally:
        await target.close()
    return {
        "kind": "loadgen",
        "command": shlex.join([sys.executable, *sys.argv[:1], *argv]),
        "target": args.target,
        "protocol": args.protocol,
        "url": args.url,
        "model": args.model,
        "model_version": args.model_version,
        "label": args.label,
        "mode": "closed" if args.concurrency is not None else "open",
        "concurrency": args.concurrency,
        "rate": args.rate,
        "arrival": args.arrival if args.rate is not None else None,
        "rows": args.rows,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in specs],
        **summarize(outcomes, t_measure, args.rows),
        "machine": machine_info(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, print the JSON line, append it to ``--out``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    record = asyncio.run(run(args, argv))
    append_result(args.out, record)
    print(json.dumps(record, sort_keys=True))
    return 0 if record["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
