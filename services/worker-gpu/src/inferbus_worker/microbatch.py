"""From a decoded micro-batch to engine inputs, and from engine outputs to replies.

Pure functions (no I/O), so the row bookkeeping is tested on its own:
requests in a micro-batch own consecutive rows in entry order; expired
requests are left out before the engine runs, and each remaining request gets
its rows of every output back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from inferbus_common import headers as h
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.wire import BatchEntry, MicroBatch, encode_tensors


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
    live, expired = [], []
    for i, e in enumerate(batch.entries):
        (expired if e.deadline_ns and e.deadline_ns <= now_ns else live).append(i)
    return live, expired


def gather_inputs(
    config: ModelConfig, batch: MicroBatch, live: Sequence[int]
) -> tuple[dict[str, np.ndarray], list[LiveRequest]]:
    """Engine inputs holding only the rows of the `live` entries.

    Inputs are zero-copy views of the message bytes when every entry is live
    or the live ones are contiguous; only a batch with holes is copied.

    Raises:
        InvalidArgument: the tensors do not match the model, or the rows the
            entries claim do not add up to the tensors' batch axis.
    """
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
    ``pre`` and ``post`` processing) to queue and compute.

    Raises:
        InvalidArgument: the request asked for an output the model lacks.
    """
    wanted = request.entry.outputs or tuple(outputs)
    unknown = [n for n in wanted if n not in outputs]
    if unknown:
        raise InvalidArgument(f"unknown output(s) {unknown}; the model has {sorted(outputs)}")
    tensors = []
    for name in wanted:
        arr = outputs[name]
        part = arr[request.start : request.stop] if batched else arr
        tensors.append(tensor_from_numpy(name, part))
    headers = {
        h.REQUEST_ID: request.entry.request_id,
        h.VERSION: ctx.version,
        h.DIGEST: ctx.digest,
        h.TIMINGS: h.format_timings(
            {"queue": queue_ms, "compute": compute_ms, **(stages_ms or {})}
        ),
        h.BATCH_SIZE: str(batch_rows),
    }
    if request.entry.traceparent:
        headers[h.TRACEPARENT] = request.entry.traceparent
    return headers, encode_tensors(tensors)


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
