"""What the batcher checks before it queues a request, and the queue entry it builds.

Requests arrive in request bundles only (a lone request is a bundle of one),
from the producers the broker lets publish on ``ib.infer.>``: gateways and
routers. The gateway validated every request in full; the batcher checks
structure (frames that decode, a layout the model takes, rows within
``max_batch_size``, a deadline not yet passed). `docs/security.md` says who may
publish where and what each hop checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferbus_batcher.batching import ModelQueue, PendingRequest
from inferbus_common import tracing
from inferbus_common.errors import DeadlineExceeded
from inferbus_common.protocol.bundles import BundledRequest
from inferbus_common.protocol.tensors import batch_signature, decode_tensors
from inferbus_common.validation import RequestChecker

if TYPE_CHECKING:
    from opentelemetry.trace import Span

QUEUE_SPAN = "inferbus.batcher.queue"


def _late(queue: ModelQueue, now_wall: int, deadline: int) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"deadline of the request for model '{queue.model}' version '{queue.version}' "
        f"passed {(now_wall - deadline) / 1e6:.1f} ms before it reached the batcher"
    )


def _queue_span(queue: ModelQueue, traceparent: str, request_id: str) -> Span | None:
    """The request's batcher span (intake to micro-batch stored), when sampled."""
    span = tracing.start_child_span(QUEUE_SPAN, traceparent)
    if span is not None:
        span.set_attribute("inferbus.model", queue.model)
        span.set_attribute("inferbus.version", queue.version)
        span.set_attribute("inferbus.request_id", request_id)
    return span


def admit(
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
    env = r.envelope
    deadline = env.deadline_ns or now_wall + queue.default_timeout_ns
    if deadline <= now_wall:
        raise _late(queue, now_wall, deadline)
    tensors = decode_tensors(r.frame)
    checker.check(tensors, env.outputs, trusted=True)
    # Unbatched models (max_batch_size 0) still report their first dim as
    # rows, so a micro-batch's dims[0] always equals the sum of its rows.
    rows = tensors[0].shape[0] if tensors and tensors[0].shape else 1
    # Time the request spent filling its gateway's bundle is time spent waiting
    # for a batch: it counts against the delay (at most one delay of credit).
    waited = min(r.held_ns, queue.delay_ns)
    span = None
    if tracing.enabled() and tracing.is_sampled(env.traceparent):
        span = _queue_span(queue, env.traceparent, env.request_id)
        if span is not None:
            # The micro-batch entry carries the span's context to the worker.
            env = env._replace(traceparent=tracing.traceparent_of(span))
    return PendingRequest(
        envelope=env,
        reply=inbox,
        token=r.token,
        deadline_ns=deadline,
        enqueued_ns=now_wall,
        enqueued_mono_ns=now_mono,
        rows=rows,
        priority=queue.priority_of(env.priority),
        signature=batch_signature(tensors),
        tensors=tensors,
        mirror=r.mirror,
        mirror_token=r.mirror_token,
        span=span,
        since_mono_ns=now_mono - waited,
    )
