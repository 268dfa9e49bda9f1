"""What the batcher checks before it queues a request, and the queue entry it builds.

Two producers: a single request (headers and one tensor frame, from anyone the
broker lets publish on the infer subjects: checked in full, a layout that passed
before is not checked again) and a request of a gateway's bundle (the gateway
validated it; structure only). `docs/security.md` says why the two differ.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from inferbus_batcher.batching import ModelQueue, PendingRequest
from inferbus_common import headers as h
from inferbus_common import tracing
from inferbus_common.bundles import BundledRequest
from inferbus_common.errors import DeadlineExceeded, InvalidArgument
from inferbus_common.validation import RequestChecker
from inferbus_common.wire import batch_signature, decode_tensors

if TYPE_CHECKING:
    from opentelemetry.trace import Span

QUEUE_SPAN = "inferbus.batcher.queue"


def start_queue_span(hdrs: dict[str, str], request_id: str) -> Span | None:
    """The request's batcher span (intake to micro-batch stored), when sampled.

    Its context replaces the request's ``traceparent`` in `hdrs`, so the
    micro-batch entry carries it to the worker.
    """
    span = tracing.start_child_span(QUEUE_SPAN, hdrs.get(h.TRACEPARENT, ""))
    if span is not None:
        span.set_attribute("inferbus.model", hdrs.get(h.MODEL, ""))
        span.set_attribute("inferbus.version", hdrs.get(h.VERSION, ""))
        span.set_attribute("inferbus.request_id", request_id)
        hdrs[h.TRACEPARENT] = tracing.traceparent_of(span)
    return span


def _late(queue: ModelQueue, now_wall: int, deadline: int) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"deadline of the request for model '{queue.model}' version '{queue.version}' "
        f"passed {(now_wall - deadline) / 1e6:.1f} ms before it reached the batcher"
    )


def admit_request(
    queue: ModelQueue,
    checker: RequestChecker,
    data: bytes,
    hdrs: dict[str, str],
    request_id: str,
    reply: str,
) -> PendingRequest:
    """Check a single request against its deadline and model config; its queue entry.

    Raises:
        InvalidArgument: a malformed deadline, frame or layout.
        DeadlineExceeded: the deadline passed before the request arrived.
    """
    now_wall = time.time_ns()
    raw_deadline = hdrs.get(h.DEADLINE)
    if raw_deadline:
        try:
            deadline = int(raw_deadline)
        except ValueError:
            raise InvalidArgument(
                f"{h.DEADLINE} must be unix-epoch nanoseconds, got {raw_deadline!r}"
            ) from None
        if deadline <= now_wall:
            raise _late(queue, now_wall, deadline)
    else:
        deadline = now_wall + queue.default_timeout_ns
    tensors = decode_tensors(data)
    raw_outputs = hdrs.get(h.OUTPUTS, "")
    outputs = tuple(o for o in raw_outputs.split(",") if o) if raw_outputs else ()
    # The gateway validated too; the batcher cannot trust that (anyone may
    # publish to its subject), but a layout that passed is not checked again.
    checker.check(tensors, outputs)
    # Unbatched models (max_batch_size 0) still report their first dim as
    # rows, so a micro-batch's dims[0] always equals the sum of its rows.
    rows = tensors[0].shape[0] if tensors[0].shape else 1
    try:
        priority = queue.priority_of(int(hdrs.get(h.PRIORITY) or 0))
    except ValueError:
        priority = queue.default_priority
    return PendingRequest(
        request_id=request_id,
        reply=reply,
        deadline_ns=deadline,
        enqueued_ns=now_wall,
        enqueued_mono_ns=time.monotonic_ns(),
        rows=rows,
        priority=priority,
        signature=batch_signature(tensors),
        tensors=tensors,
        outputs=outputs,
        traceparent=hdrs.get(h.TRACEPARENT, ""),
        mirror=hdrs.get(h.MIRROR, ""),
    )


def admit_bundled(
    queue: ModelQueue,
    checker: RequestChecker,
    r: BundledRequest,
    inbox: str,
    now_wall: int,
    now_mono: int,
) -> PendingRequest:
    """Check one request of a bundle (deadline, structure); its queue entry.

    Raises:
        InvalidArgument: frames that do not decode or a layout the model does not take.
        DeadlineExceeded: the deadline passed before the bundle arrived.
    """
    deadline = r.deadline_ns or now_wall + queue.default_timeout_ns
    if deadline <= now_wall:
        raise _late(queue, now_wall, deadline)
    tensors = decode_tensors(r.frame)
    checker.check(tensors, r.outputs, trusted=True)
    rows = tensors[0].shape[0] if tensors[0].shape else 1
    # Time the request spent filling its gateway's bundle is time spent waiting
    # for a batch: it counts against the delay (at most one delay of credit).
    waited = min(r.held_ns, queue.delay_ns)
    span = None
    if tracing.enabled() and tracing.is_sampled(r.traceparent):
        span = start_queue_span(
            {h.TRACEPARENT: r.traceparent, h.MODEL: queue.model, h.VERSION: queue.version},
            r.request_id,
        )
    return PendingRequest(
        request_id=r.request_id,
        reply=inbox,
        deadline_ns=deadline,
        enqueued_ns=now_wall,
        enqueued_mono_ns=now_mono,
        rows=rows,
        priority=queue.priority_of(r.priority),
        signature=batch_signature(tensors),
        tensors=tensors,
        outputs=r.outputs,
        traceparent=tracing.traceparent_of(span) if span is not None else r.traceparent,
        mirror=r.mirror,
        span=span,
        token=r.token,
        mirror_token=r.mirror_token,
        since_mono_ns=now_mono - waited,
    )
