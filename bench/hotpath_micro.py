"""CPU cost of single hot-path steps, old way vs new way, in one process.

End-to-end A/B runs on the shared 2-core machine move by more than a few
microseconds per request, so the per-request steps changed in round 2 are
also measured here in isolation (CPU time per call, best of ``--repeat``
rounds of ``--number`` calls)::

    uv run python bench/hotpath_micro.py

Steps: a worker's per-reply counter (``labels(**kw)`` vs the cached child,
changed), and references that were not changed: the router's read of an
audit record (pydantic ``AuditRecord`` vs a plain ``json.loads`` of the four
fields it needs; pydantic is faster, so it stays), the gateway's audit-record
encoding (``json.dumps`` vs ``orjson``) and its access-log line.

Round 3 (gateway, issue #10), each changed: the wait for a reply
(``asyncio.wait_for`` vs a ``call_later`` timer on the reply's future, on
uvloop like the services), the access-log line (``Logger.info`` vs
``handle(makeRecord(...))``, no caller lookup) and the answered-request
metrics (``labels(...)`` twice vs the cached children).

Round 5 (batcher and worker CPU per request, issue #10), fraud model
(64 FP32 inputs, 2 outputs): re-validating a request layout that passed
(``ModelConfig.validate_request`` vs `RequestChecker`, batcher per request,
worker per micro-batch) and the worker's reply counter (``inc()`` per reply
vs once per execution). (Round 5 also compared single OK replies per request
with `BatchReplies`; single replies went with the single-request path in
issue 25, so that step is gone: findings.md keeps its figures.)
Run only these with ``--round 5``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import orjson
import uvloop
from prometheus_client import CollectorRegistry, Counter, Histogram

from inferbus_common.audit import encode_record
from inferbus_common.logs import JsonFormatter
from inferbus_router.health import NOT_THE_VERSIONS_FAULT, HealthPolicy, HealthWeights

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples/fraud"))


def cpu_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Best per-call CPU time (µs) of `fn` over `repeat` rounds of `number` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(number):
            fn()
        best = min(best, (time.process_time() - t0) / number)
    return best * 1e6


def loop_cpu_us(make: Callable[[], Awaitable[object]], number: int, repeat: int) -> float:
    """`cpu_us` for a coroutine step, awaited `number` times on one uvloop loop."""

    async def rounds() -> float:
        best = float("inf")
        for _ in range(repeat):
            t0 = time.process_time()
            for _ in range(number):
                await make()
            best = min(best, (time.process_time() - t0) / number)
        return best * 1e6

    return uvloop.run(rounds())


async def reply_wait_for() -> object:
    """The gateway's wait for a reply before round 3: `asyncio.wait_for`."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_soon(fut.set_result, None)  # the reply, one loop turn later
    return await asyncio.wait_for(fut, 10.0)


def _expire(fut: asyncio.Future[object]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


async def reply_timer() -> object:
    """Round 3 (`Dispatcher.call`): a timer on the reply's own future."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_soon(fut.set_result, None)
    timer = loop.call_later(10.0, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


def round5_steps() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """Round 5's steps (batcher and worker per request), old way vs new way."""
    import numpy as np
    from make_model import model_config

    from inferbus_common.codec import tensor_from_numpy
    from inferbus_common.protocol.microbatch import BatchEntry, MicroBatch
    from inferbus_common.validation import RequestChecker
    from inferbus_worker.microbatch import LiveRequest

    config = model_config("fraud", 64, 2)
    rng = np.random.default_rng(0)
    one = [tensor_from_numpy("input", rng.random((1, 64), dtype=np.float32))]
    four = [tensor_from_numpy("input", rng.random((4, 64), dtype=np.float32))]
    checker = RequestChecker(config)
    checker.check(one)
    checker.check(four)
    rows = 8
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    requests = [
        LiveRequest(BatchEntry(f"req-{i:028d}", f"_INBOX.x.{i}", 0, 1, 1, (), tp), i)
        for i in range(rows)
    ]
    MicroBatch([r.entry for r in requests], four)  # the layout the worker receives
    registry = CollectorRegistry()
    replies = Counter("r5", "r5", ["model", "version", "status"], registry=registry)
    child = replies.labels("fraud", "1", "OK")

    def count_old() -> None:
        for _ in range(rows):
            child.inc()

    return [
        (
            "batcher: validate one request, 1 row (validate_request vs RequestChecker)",
            lambda: config.validate_request(one, ()),
            lambda: checker.check(one, ()),
        ),
        (
            "worker: validate a micro-batch, 4 rows (validate_request vs RequestChecker)",
            lambda: config.validate_request(four),
            lambda: checker.check(four),
        ),
        (
            "worker: count 8 OK replies (inc() each vs inc(8) once)",
            count_old,
            lambda: child.inc(rows),
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: one JSON line per step with old/new µs and their ratio."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--round", type=int, default=None, help="only this round's steps (5)")
    args = p.parse_args(argv)
    n, r = args.number, args.repeat
    if args.round == 5:
        for name, old, new in round5_steps():
            old_us = cpu_us(old, n, r)
            new_us = cpu_us(new, n, r)
            line = {"step": name, "old_us": round(old_us, 2), "new_us": round(new_us, 2)}
            print(json.dumps(line | {"ratio": round(new_us / old_us, 3)}), flush=True)
        return 0
    record_args = dict(
        request_id="0123456789abcdef0123456789abcdef",
        ts_unix_ms=1_700_000_000_000,
        gateway="gw-1",
        protocol="grpc",
        tenant="acme",
        model="fraud",
        version="1",
        digest="sha256:" + "ab" * 32,
        status="OK",
        reason="",
        latency_ms=3.21,
        stages_ms={"gateway": 0.1, "queue": 0.9, "compute": 0.3, "total": 2.8},
    )
    data = encode_record(**record_args)
    health = HealthWeights(HealthPolicy())

    def audit_json() -> None:
        rec = json.loads(data)
        version = rec["version"]
        if version:
            error = rec["status"] not in NOT_THE_VERSIONS_FAULT
            health.record(rec["model"], version, error, float(rec["latency_ms"]))

    registry = CollectorRegistry()
    replies = Counter("r", "r", ["model", "version", "status"], registry=registry)
    labels = {"model": "fraud", "version": "1"}
    children: dict[tuple[object, ...], Counter] = {}

    def counter_cached() -> None:
        key = (replies, "OK")
        child = children.get(key)
        if child is None:
            child = children[key] = replies.labels(**labels, status="OK")
        child.inc()

    requests = Counter("q", "q", ["model", "version", "protocol", "status"], registry=registry)
    latency = Histogram("l", "l", ["model", "protocol"], registry=registry)
    answered: dict[tuple[str, str, str], tuple[Counter, Histogram]] = {}

    def answered_labels() -> None:
        requests.labels("fraud", "1", "grpc", "OK").inc()
        latency.labels("fraud", "grpc").observe(0.003)

    def answered_cached() -> None:
        key = ("fraud", "1", "grpc")
        children = answered.get(key)
        if children is None:
            children = answered[key] = (
                requests.labels("fraud", "1", "grpc", "OK"),
                latency.labels("fraud", "grpc"),
            )
        children[0].inc()
        children[1].observe(0.003)

    stamped = dict(record_args)
    stamped["stages_ms"] = {k: round(v, 3) for k, v in record_args["stages_ms"].items()}

    with tempfile.TemporaryDirectory() as tmp:
        log = logging.getLogger("bench.access")
        log.propagate = False
        handler = logging.FileHandler(Path(tmp) / "access.log")
        handler.setFormatter(JsonFormatter("gateway"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        extra = {
            "model": "fraud",
            "status": "OK",
            "latency_ms": 3.21,
            "protocol": "grpc",
            "request_id": "0123456789abcdef0123456789abcdef",
            "version": "1",
        }
        steps = [
            (
                "router: read one audit record for health (pydantic vs json.loads; not changed)",
                lambda: health.observe(data),
                audit_json,
            ),
            (
                "worker: count one reply (labels(**kw) vs cached child)",
                lambda: replies.labels(**labels, status="OK").inc(),
                counter_cached,
            ),
            (
                "gateway: encode the audit record (json vs orjson; not changed)",
                lambda: encode_record(**record_args),
                lambda: orjson.dumps(stamped),
            ),
            (
                "gateway: one access-log line to a file (info vs handle(makeRecord))",
                lambda: log.info("infer", extra=extra),
                lambda: log.handle(
                    log.makeRecord(log.name, logging.INFO, __file__, 0, "infer", (), None, extra)
                ),
            ),
            (
                "gateway: count and time an answered request (labels twice vs cached)",
                answered_labels,
                answered_cached,
            ),
        ]
        for name, old, new in steps:
            old_us = cpu_us(old, n, r)
            line: dict[str, object] = {"step": name, "old_us": round(old_us, 2)}
            if new is not None:
                new_us = cpu_us(new, n, r)
                line |= {"new_us": round(new_us, 2), "ratio": round(new_us / old_us, 3)}
            print(json.dumps(line), flush=True)
        handler.close()
    old_us = loop_cpu_us(reply_wait_for, n, r)
    new_us = loop_cpu_us(reply_timer, n, r)
    step = "gateway: wait for a reply (asyncio.wait_for vs call_later timer)"
    print(
        json.dumps(
            {
                "step": step,
                "old_us": round(old_us, 2),
                "new_us": round(new_us, 2),
                "ratio": round(new_us / old_us, 3),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
