"""``inferbus replay``: send captured requests of one version to another and compare.

Captured requests (gateway setting ``capture_rate``) are read from the audit
stream (``<prefix>.audit.payload.<model>.<from>``), sent again through the
gateway's KServe V2 gRPC API pinned to ``--to`` and each answer is compared
with the captured one:

* integer, boolean and BYTES outputs must be equal;
* float outputs must be close (``|a - b| <= atol + rtol * |b|``);
* for float outputs with a class axis (2-D and more), the argmax per row is
  compared too, and the rows whose top class changed are counted.

The report names every request whose answers differ (and every request that
failed on ``--to``), so a release can be judged on real traffic before it
takes any.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import nats
import nats.errors
import nats.js.errors
import numpy as np

from inferbus_cli.busclient import connect_nats, nats_url
from inferbus_cli.rpc import MAX_MESSAGE_BYTES, inference_stub
from inferbus_cli.state import default_gateway_address, resolve_home
from inferbus_cli.tensors import output_arrays
from inferbus_common.audittrail import read_captures
from inferbus_common.capture import CapturedRequest
from inferbus_common.registrychannel import message_size_options
from inferbus_common.subjects import Subjects
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

FLOAT_KINDS = "fc"


@dataclass(slots=True)
class OutputDiff:
    """How one output differs between the captured and the replayed answer."""

    name: str
    reason: str
    """``values``, ``shape``, ``datatype`` or ``missing``."""
    mismatched: int = 0
    """Elements outside the tolerance (or unequal)."""
    max_abs_diff: float | None = None
    argmax_changed_rows: int | None = None


@dataclass(slots=True)
class RequestDiff:
    """A replayed request whose answer differs."""

    request_id: str
    outputs: list[OutputDiff]


@dataclass(slots=True)
class ReplayReport:
    """What a replay found."""

    model: str
    from_version: str
    to_version: str
    since_s: float
    replayed: int = 0
    same: int = 0
    different: int = 0
    failed: int = 0
    differences: list[RequestDiff] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    """Request id → the error the replay got."""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (differences sorted by request id)."""
        doc = asdict(self)
        doc["differences"] = sorted(doc["differences"], key=lambda d: d["request_id"])
        doc["different_ids"] = sorted(d.request_id for d in self.differences)
        return doc


def compare_output(
    name: str, before: np.ndarray, after: np.ndarray, *, atol: float, rtol: float
) -> OutputDiff | None:
    """The difference of one output, or None when it is the same within tolerance."""
    if before.shape != after.shape:
        return OutputDiff(name, "shape", mismatched=max(before.size, after.size))
    if before.dtype.kind in FLOAT_KINDS and after.dtype.kind in FLOAT_KINDS:
        a = before.astype(np.float64)
        b = after.astype(np.float64)
        close = np.isclose(b, a, atol=atol, rtol=rtol, equal_nan=True)
        argmax_changed = None
        if a.ndim >= 2 and a.shape[-1] > 1:
            argmax_changed = int(np.sum(np.argmax(a, axis=-1) != np.argmax(b, axis=-1)))
        if bool(close.all()) and not argmax_changed:
            return None
        with np.errstate(invalid="ignore"):
            diff = np.abs(a - b)
        return OutputDiff(
            name,
            "values",
            mismatched=int((~close).sum()),
            max_abs_diff=float(np.nanmax(diff)) if diff.size else 0.0,
            argmax_changed_rows=argmax_changed,
        )
    if before.dtype.kind != after.dtype.kind and not (
        before.dtype.kind in "O" or after.dtype.kind in "O"
    ):
        return OutputDiff(name, "datatype", mismatched=before.size)
    equal = np.asarray(before == after)
    if bool(equal.all()):
        return None
    return OutputDiff(name, "values", mismatched=int((~equal).sum()))


def compare_answers(
    request_id: str,
    before: dict[str, np.ndarray],
    after: dict[str, np.ndarray],
    *,
    atol: float,
    rtol: float,
) -> RequestDiff | None:
    """Compare every captured output with the replayed one (None: all the same)."""
    diffs: list[OutputDiff] = []
    for name, old in before.items():
        new = after.get(name)
        if new is None:
            diffs.append(OutputDiff(name, "missing", mismatched=old.size))
            continue
        d = compare_output(name, old, new, atol=atol, rtol=rtol)
        if d is not None:
            diffs.append(d)
    return RequestDiff(request_id, diffs) if diffs else None


def build_replay_request(captured: CapturedRequest, to_version: str) -> pb.ModelInferRequest:
    """The captured request as a ModelInferRequest pinned to `to_version`.

    The id gets a ``.replay`` suffix: the audit trail then tells the replay
    from the original, and the gateway's idempotency cache never answers it
    with the original's result.
    """
    request = pb.ModelInferRequest(
        model_name=captured.model,
        model_version=to_version,
        id=f"{captured.request_id}.replay"[:256],
    )
    for t in captured.inputs:
        request.inputs.append(
            pb.ModelInferRequest.InferInputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
        )
        request.raw_input_contents.append(bytes(t.data))
    for name in captured.requested_outputs:
        request.outputs.append(pb.ModelInferRequest.InferRequestedOutputTensor(name=name))
    return request


async def replay(
    *,
    nats_server: str,
    gateway: str,
    prefix: str,
    model: str,
    from_version: str,
    to_version: str,
    since_s: float,
    limit: int | None,
    atol: float,
    rtol: float,
    concurrency: int = 8,
    timeout_s: float = 30.0,
) -> ReplayReport:
    """Read the captures of `from_version`, replay them on `to_version`, compare.

    Raises:
        nats.js.errors.NotFoundError: no audit stream (capture never ran).
    """
    report = ReplayReport(model, from_version, to_version, since_s)
    subjects = Subjects(prefix)
    # Captures are read and replayed as a stream: at most `concurrency`
    # requests are held at a time, however long the window.
    sem = asyncio.Semaphore(concurrency)
    nc = await connect_nats(nats_server)
    try:
        async with grpc.aio.insecure_channel(
            gateway, options=message_size_options(MAX_MESSAGE_BYTES)
        ) as channel:
            stub = inference_stub(channel)

            async def one(captured: CapturedRequest) -> None:
                try:
                    response = await stub.ModelInfer(
                        build_replay_request(captured, to_version), timeout=timeout_s
                    )
                except grpc.aio.AioRpcError as exc:
                    report.failed += 1
                    report.failures[captured.request_id] = f"{exc.code().name}: {exc.details()}"
                    return
                finally:
                    sem.release()
                before = {t.name: t.as_numpy() for t in captured.outputs}
                diff = compare_answers(
                    captured.request_id, before, output_arrays(response), atol=atol, rtol=rtol
                )
                report.replayed += 1
                if diff is None:
                    report.same += 1
                else:
                    report.different += 1
                    report.differences.append(diff)

            tasks: list[asyncio.Task[None]] = []
            try:
                async for captured in read_captures(
                    nc.jetstream(),
                    subjects,
                    model,
                    from_version,
                    since_unix_s=time.time() - since_s,
                    limit=limit,
                ):
                    await sem.acquire()
                    tasks.append(asyncio.create_task(one(captured)))
            finally:
                await asyncio.gather(*tasks)
    finally:
        await nc.close()
    return report


def _print_text(report: ReplayReport) -> None:
    print(
        f"replay {report.model}: version {report.from_version} → {report.to_version}, "
        f"captures of the last {report.since_s:g}s"
    )
    print(
        f"  replayed {report.replayed}: {report.same} same, {report.different} different; "
        f"{report.failed} failed"
    )
    for d in sorted(report.differences, key=lambda d: d.request_id):
        parts = []
        for o in d.outputs:
            text = f"{o.name}: {o.reason} ({o.mismatched} elements"
            if o.max_abs_diff is not None:
                text += f", max |diff| {o.max_abs_diff:.4g}"
            if o.argmax_changed_rows:
                text += f", argmax changed in {o.argmax_changed_rows} row(s)"
            parts.append(text + ")")
        print(f"  DIFF {d.request_id}: " + "; ".join(parts))
    for rid, err in sorted(report.failures.items()):
        print(f"  FAIL {rid}: {err}")
    if report.replayed == 0 and report.failed == 0:
        print(
            "  nothing to replay: no captures of this version in that window; is payload "
            "capture on (gateway INFERBUS_GATEWAY_CAPTURE_RATE > 0)?"
        )


def run(args: argparse.Namespace) -> int:
    """Replay captured traffic and print the report; 1 on an error."""
    gateway = args.url or default_gateway_address(resolve_home(args.home))
    try:
        report = asyncio.run(
            replay(
                nats_server=nats_url(args),
                gateway=gateway,
                prefix=args.prefix,
                model=args.model,
                from_version=args.from_version,
                to_version=args.to_version,
                since_s=args.since,
                limit=args.limit,
                atol=args.atol,
                rtol=args.rtol,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
            )
        )
    except nats.js.errors.NotFoundError:
        print(
            "error: there is no audit stream on this NATS; start the gateway with "
            "INFERBUS_GATEWAY_CAPTURE_RATE > 0 to capture traffic first",
            file=sys.stderr,
        )
        return 1
    except (nats.errors.Error, OSError) as exc:
        print(f"error: cannot read the audit stream: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_text(report)
    return 0
