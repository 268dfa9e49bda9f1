"""From a decoded micro-batch to engine inputs, and from engine outputs to replies.

Pure row bookkeeping (tested on its own): requests in a micro-batch own
consecutive rows in entry order; expired requests are left out before the
engine runs, and each remaining request gets its rows of every output back.
`Outbox` collects the answers of one run and sends them: one reply bundle per
gateway inbox (and per mirror inbox), the only way a worker answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from nats.aio.client import Client

from inferbus_common.codec import Buffer
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import BundledReply, ReplyGroups
from inferbus_common.protocol.microbatch import BatchEntry, MicroBatch
from inferbus_common.protocol.tensors import RowFrames
from inferbus_common.validation import RequestChecker


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
    compute and stage timings) is prepared once; `frame_parts` then costs a
    few slices per request.

    Args:
        outputs: the engine's outputs for the whole execution.
        batched: whether the model has a batch axis (requests get their rows).
        compute_ms: engine time of the execution.
        stages_ms: further stage timings (e.g. ``pre`` and ``post``).
    """

    __slots__ = ("_batched", "_frames", "_names", "_outputs", "shared_timings")

    def __init__(
        self,
        outputs: Mapping[str, np.ndarray],
        *,
        batched: bool,
        compute_ms: float,
        stages_ms: Mapping[str, float] | None = None,
    ) -> None:
        self._outputs = outputs
        self._names = tuple(outputs)
        self._batched = batched
        self._frames = RowFrames(outputs)
        self.shared_timings = h.format_timings({"compute": compute_ms, **(stages_ms or {})})
        """The stage timings every reply of the run shares (a reply bundle carries
        them once; each reply adds its own queue time)."""

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
        """The pieces of one computed request's outputs frame (for its reply bundle).

        Holds the request's rows of the outputs it asked for (all when it
        named none).

        Raises:
            InvalidArgument: the request asked for an output the model lacks.
        """
        return self._frames.frame_parts(
            self._wanted(request), request.start, request.stop, sliced=self._batched
        )


class Outbox:
    """The answers of one engine run (or one refusal), sent together after it.

    Every request is answered in its gateway inbox's reply bundle; a mirror
    copy (shadow compare) likewise in its mirror inbox's bundle.

    Args:
        ctx: the version answering.
        timings: stage timings shared by the run's replies.
        batch_rows: rows in the run (0 when nothing was computed).
    """

    __slots__ = ("_groups", "counts")

    def __init__(self, ctx: ReplyContext, timings: str = "", batch_rows: int = 0) -> None:
        self._groups = ReplyGroups(ctx.version, ctx.digest, timings, batch_rows)
        self.counts: dict[str, int] = {}
        """Answers by status name ("OK", "INVALID_ARGUMENT", ...)."""

    def _add(self, entry: BatchEntry, status: str, reply: BundledReply, frame: Sequence[Buffer]):
        if entry.reply:
            self._groups.add(entry.reply, reply, frame)
        if entry.mirror:
            mirrored = BundledReply(
                entry.mirror_token, reply.status, reply.error, reply.reason, reply.queue_ms
            )
            self._groups.add(entry.mirror, mirrored, frame)
        self.counts[status] = self.counts.get(status, 0) + 1

    def ok(self, entry: BatchEntry, queue_ms: float, parts: Sequence[Buffer]) -> None:
        """Answer a request with its outputs frame (`parts`)."""
        self._add(entry, "OK", BundledReply(entry.token, queue_ms=queue_ms), parts)

    def error(self, entry: BatchEntry, code: StatusCode, message: str) -> None:
        """Answer one request with an error (cut to one line when encoded)."""
        self._add(entry, code.name, BundledReply(entry.token, code.name, message), ())

    def __len__(self) -> int:
        return sum(self.counts.values())

    async def send(self, nc: Client) -> None:
        """Publish the reply bundles, one per inbox."""
        for inbox, payload in self._groups.messages():
            await nc.publish(inbox, payload)
