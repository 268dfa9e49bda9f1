"""From a decoded micro-batch to engine inputs, and from engine outputs to replies.

Pure row bookkeeping (tested on its own): requests in a micro-batch own
consecutive rows in entry order; expired requests are left out before the
engine runs, and each remaining request gets its rows of every output back.
`Outbox` collects the answers of one run and sends them: one reply bundle per
gateway inbox for bundled requests, a single reply for the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from nats.aio.client import Client

from inferbus_common import headers as h
from inferbus_common.bundles import BundledReply, ReplyGroups
from inferbus_common.codec import Buffer
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.validation import RequestChecker
from inferbus_common.wire import BatchEntry, MicroBatch, RowFrames


@dataclass(slots=True)
class LiveRequest:
    """A request that will be computed, and where its rows are in the engine batch.

    Attributes:
        entry: the request as carried in the micro-batch.
        start: first row of the request in the engine's inputs and outputs.
    """

    entry: BatchEntry
    start: int

    @property
    def stop(self) -> int:
        """One past the request's last row."""
        return self.start + self.entry.rows


def split_expired(batch: MicroBatch, now_ns: int) -> tuple[list[int], list[int]]:
    """Indexes of entries still in time and of entries whose deadline passed.

    A deadline of 0 means none.
    """
    live: list[int] = []
    expired: list[int] = []
    for i, e in enumerate(batch.entries):
        (expired if e.deadline_ns and e.deadline_ns <= now_ns else live).append(i)
    return live, expired


def gather_inputs(
    config: ModelConfig,
    batch: MicroBatch,
    live: Sequence[int],
    checker: RequestChecker | None = None,
) -> tuple[dict[str, np.ndarray], list[LiveRequest]]:
    """Engine inputs holding only the rows of the `live` entries.

    Inputs are zero-copy views of the message bytes when every entry is live
    or the live ones are contiguous; only a batch with holes is copied.
    `checker` (bound to `config`) skips re-validating tensor layouts that
    passed before; without it the tensors are validated in full.

    Raises:
        InvalidArgument: the tensors do not match the model, or the rows the
            entries claim do not add up to the tensors' batch axis.
    """
    if checker is not None:
        checker.check(batch.tensors, trusted=True)
    else:
        config.validate_request(batch.tensors)
    batched = config.max_batch_size > 0
    if not batched and len(batch.entries) != 1:
        raise InvalidArgument(
            f"{config.name}: a model without a batch axis takes one request per batch"
        )
    offsets = []
    row = 0
    for e in batch.entries:
        offsets.append(row)
        row += e.rows
    arrays = {t.name: t.as_numpy() for t in batch.tensors}
    if batched:
        for name, arr in arrays.items():
            if arr.shape[0] != row:
                raise InvalidArgument(
                    f"{config.name}: tensor '{name}' has {arr.shape[0]} rows but the "
                    f"micro-batch entries claim {row}"
                )
    if not batched or len(live) == len(batch.entries):
        requests = [LiveRequest(batch.entries[i], offsets[i]) for i in live]
        return arrays, requests
    spans = [(offsets[i], offsets[i] + batch.entries[i].rows) for i in live]
    contiguous = all(spans[k][1] == spans[k + 1][0] for k in range(len(spans) - 1))
    if contiguous:
        lo, hi = spans[0][0], spans[-1][1]
        inputs = {name: arr[lo:hi] for name, arr in arrays.items()}
    else:
        inputs = {
            name: np.concatenate([arr[a:b] for a, b in spans], axis=0)
            for name, arr in arrays.items()
        }
    requests = []
    row = 0
    for i in live:
        requests.append(LiveRequest(batch.entries[i], row))
        row += batch.entries[i].rows
    return inputs, requests


@dataclass(frozen=True, slots=True)
class ReplyContext:
    """What every reply of one model version says about where it came from."""

    version: str
    digest: str


class BatchReplies:
    """The OK replies of one engine execution, one request at a time.

    What all replies of the execution share (the outputs' tensor layout, the
    compute and stage timings, the batch size) is prepared once; `ok` then
    costs a few slices per request.

    Args:
        ctx: the version's reply context.
        outputs: the engine's outputs for the whole execution.
        batched: whether the model has a batch axis (requests get their rows).
        compute_ms: engine time of the execution.
        batch_rows: rows in the execution.
        stages_ms: further stage timings (e.g. ``pre`` and ``post``).
    """

    __slots__ = (
        "_batch_rows",
        "_batched",
        "_ctx",
        "_frames",
        "_names",
        "_outputs",
        "_timings",
        "_timings_all",
        "shared_timings",
    )

    def __init__(
        self,
        ctx: ReplyContext,
        outputs: Mapping[str, np.ndarray],
        *,
        batched: bool,
        compute_ms: float,
        batch_rows: int,
        stages_ms: Mapping[str, float] | None = None,
    ) -> None:
        self._ctx = ctx
        self._outputs = outputs
        self._names = tuple(outputs)
        self._batched = batched
        self._frames = RowFrames(outputs)
        self._batch_rows = str(batch_rows)
        # Everything after the per-request queue time, formatted once.
        timings = {"compute": compute_ms, **(stages_ms or {})}
        self._timings_all = timings
        self._timings = (
            "".join(f";{k}={v:.3f}" for k, v in timings.items()) if "queue" not in timings else None
        )
        self.shared_timings = h.format_timings(timings)
        """The stage timings every reply of the run shares (reply bundles carry them once)."""

    def _wanted(self, request: LiveRequest) -> Sequence[str]:
        outputs = self._outputs
        wanted = request.entry.outputs or self._names
        for name in wanted:
            if name not in outputs:
                unknown = [n for n in wanted if n not in outputs]
                raise InvalidArgument(
                    f"unknown output(s) {unknown}; the model has {sorted(outputs)}"
                )
        return wanted

    def frame_parts(self, request: LiveRequest) -> list[Buffer]:
        """The pieces of one computed request's outputs frame (for a reply bundle).

        Raises:
            InvalidArgument: the request asked for an output the model lacks.
        """
        return self._frames.frame_parts(
            self._wanted(request), request.start, request.stop, sliced=self._batched
        )

    def ok(self, request: LiveRequest, queue_ms: float) -> tuple[dict[str, str], bytes]:
        """Headers and body answering one computed request (see `ok_reply`).

        Raises:
            InvalidArgument: the request asked for an output the model lacks.
        """
        wanted = self._wanted(request)
        body = self._frames.frame(wanted, request.start, request.stop, sliced=self._batched)
        ctx = self._ctx
        headers = {
            h.REQUEST_ID: request.entry.request_id,
            h.VERSION: ctx.version,
            h.DIGEST: ctx.digest,
            h.TIMINGS: f"queue={queue_ms:.3f}{self._timings}"
            if self._timings is not None
            else h.format_timings({"queue": queue_ms, **self._timings_all}),
            h.BATCH_SIZE: self._batch_rows,
        }
        if request.entry.traceparent:
            headers[h.TRACEPARENT] = request.entry.traceparent
        return headers, body


def ok_reply(
    ctx: ReplyContext,
    request: LiveRequest,
    outputs: Mapping[str, np.ndarray],
    *,
    batched: bool,
    queue_ms: float,
    compute_ms: float,
    batch_rows: int,
    stages_ms: Mapping[str, float] | None = None,
) -> tuple[dict[str, str], bytes]:
    """Headers and body answering one computed request.

    The body holds the request's rows of the outputs it asked for (all when
    it named none), as a tensor frame. `stages_ms` adds stage timings (e.g.
    ``pre`` and ``post`` processing) to queue and compute. For many requests
    of one execution, `BatchReplies` does the shared work once.

    Raises:
        InvalidArgument: the request asked for an output the model lacks.
    """
    replies = BatchReplies(
        ctx,
        outputs,
        batched=batched,
        compute_ms=compute_ms,
        batch_rows=batch_rows,
        stages_ms=stages_ms,
    )
    return replies.ok(request, queue_ms)


def error_reply(
    ctx: ReplyContext, entry: BatchEntry, code: StatusCode, message: str
) -> tuple[dict[str, str], bytes]:
    """Headers and (empty) body answering one request with an error."""
    headers = {
        h.REQUEST_ID: entry.request_id,
        h.VERSION: ctx.version,
        h.DIGEST: ctx.digest,
        h.STATUS: code.name,
        # Header values cannot hold line breaks; engine messages often do.
        h.ERROR: " ".join(message.split())[:1024],
    }
    if entry.traceparent:
        headers[h.TRACEPARENT] = entry.traceparent
    return headers, b""


class Outbox:
    """The answers of one engine run (or one refusal), sent together after it.

    Bundled requests (a token) are answered in one reply bundle per inbox, a
    mirror copy likewise in its own inbox's bundle; the others get single
    replies (and single mirror copies), the client's before the mirror's.

    Args:
        ctx: the version answering.
        timings: stage timings shared by the run's replies (reply bundles).
        batch_rows: rows in the run (0 when nothing was computed).
    """

    __slots__ = ("_ctx", "_groups", "_singles", "counts")

    def __init__(self, ctx: ReplyContext, timings: str = "", batch_rows: int = 0) -> None:
        self._ctx = ctx
        self._groups = ReplyGroups(ctx.version, ctx.digest, timings, batch_rows)
        self._singles: list[tuple[str, dict[str, str], bytes]] = []
        self.counts: dict[str, int] = {}
        """Answers by status name ("OK", "INVALID_ARGUMENT", ...)."""

    def _count(self, status: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1

    def ok(self, entry: BatchEntry, queue_ms: float, parts: Sequence[Buffer]) -> None:
        """Answer a bundled request with its outputs frame (`parts`)."""
        self._groups.add(entry.reply, BundledReply(entry.token, queue_ms=queue_ms), parts)
        if entry.mirror:
            self._mirror(entry, BundledReply(entry.mirror_token, queue_ms=queue_ms), parts)
        self._count("OK")

    def single(self, entry: BatchEntry, headers: dict[str, str], body: bytes, status: str) -> None:
        """Answer a request that came alone with a ready single reply."""
        if entry.reply:
            self._singles.append((entry.reply, headers, body))
        if entry.mirror:
            if entry.mirror_token:
                self._groups.add(
                    entry.mirror,
                    BundledReply(
                        entry.mirror_token, headers.get(h.STATUS, ""), headers.get(h.ERROR, "")
                    ),
                    (body,) if body else (),
                )
            else:
                self._singles.append((entry.mirror, headers, body))
        self._count(status)

    def _mirror(self, entry: BatchEntry, reply: BundledReply, parts: Sequence[Buffer]) -> None:
        if entry.mirror_token:
            self._groups.add(entry.mirror, reply, parts)
        else:
            headers = {h.REQUEST_ID: entry.request_id, h.VERSION: self._ctx.version}
            if reply.status:
                headers[h.STATUS] = reply.status
                headers[h.ERROR] = reply.error
            self._singles.append((entry.mirror, headers, b"".join(parts)))

    def error(self, entry: BatchEntry, code: StatusCode, message: str) -> None:
        """Answer one request with an error."""
        if not entry.token:
            headers, body = error_reply(self._ctx, entry, code, message)
            self.single(entry, headers, body, code.name)
            return
        reply = BundledReply(entry.token, code.name, message)
        if entry.reply:
            self._groups.add(entry.reply, reply)
        if entry.mirror:
            self._mirror(entry, BundledReply(entry.mirror_token, code.name, message), ())
        self._count(code.name)

    def __len__(self) -> int:
        return sum(self.counts.values())

    async def send(self, nc: Client) -> None:
        """Publish everything collected (single replies first, then the bundles)."""
        publish = nc.publish
        for subject, headers, body in self._singles:
            await publish(subject, body, headers=headers)
        for inbox, payload in self._groups.messages():
            await publish(inbox, payload)
