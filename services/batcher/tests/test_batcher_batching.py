"""Unit tests of batch formation (`ModelQueue`): pure, no NATS, no sleeping."""

from __future__ import annotations

import itertools

import pytest

from inferbus_batcher.batching import ModelQueue, PendingRequest
from inferbus_common.codec import Tensor
from inferbus_common.errors import InvalidArgument, ResourceExhausted
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import batch_signature

US = 1_000
MS = 1_000_000
WALL0 = 1_800_000_000 * 1_000_000_000  # a fixed "unix now" in ns
_ids = itertools.count()


def make_config(
    *,
    max_batch_size: int = 8,
    delay_us: int = 1000,
    preferred: list[int] | None = None,
    max_queue_size: int = 100,
    levels: int = 1,
    default_priority: int = 1,
) -> ModelConfig:
    shape = [-1, 4] if max_batch_size > 0 else [2, 4]
    return ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        inputs=[{"name": "x", "datatype": "FP32", "shape": shape}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": shape}],
        batching={
            "max_queue_delay_us": delay_us,
            "preferred_batch_sizes": preferred or [],
            "max_queue_size": max_queue_size,
            "priority_levels": levels,
            "default_priority": default_priority,
        },
    )


def req(
    rows: int = 1,
    *,
    at_us: int = 0,
    priority: int = 1,
    width: int = 4,
    deadline_ns: int = WALL0 + 10_000 * MS,
) -> PendingRequest:
    tensors = [Tensor("x", "FP32", (rows, width), bytes(rows * width * 4))]
    return PendingRequest(
        envelope=Envelope(f"r{next(_ids)}", "m", deadline_ns),
        reply="inbox",
        token=1,
        deadline_ns=deadline_ns,
        enqueued_ns=WALL0 + at_us * US,
        enqueued_mono_ns=at_us * US,
        rows=rows,
        priority=priority,
        signature=batch_signature(tensors),
        tensors=tensors,
    )


def take(q: ModelQueue, at_us: int, **kw: object):
    return q.take_ready(at_us * US, WALL0 + at_us * US, **kw)


def sizes(dispatch) -> list[int]:
    return [b.rows for b in dispatch.batches]


def test_full_batch_goes_at_once_and_rest_waits() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=4))
    for _ in range(3):
        q.offer(req())
        assert take(q, 0).batches == []
    q.offer(req())
    q.offer(req())
    out = take(q, 0)
    assert sizes(out) == [4]
    assert q.depth == 1
    # The leftover waits until its delay; the wake time says exactly when.
    assert q.wake_mono_ns == 1000 * US


def test_delay_sends_a_partial_batch() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=8, delay_us=1000))
    q.offer(req(at_us=0))
    q.offer(req(at_us=300))
    assert take(q, 300).batches == []
    assert q.wake_mono_ns == 1000 * US
    assert take(q, 999).batches == []
    out = take(q, 1000)
    assert sizes(out) == [2]
    assert q.depth == 0
    assert q.wake_mono_ns is None


def test_zero_delay_sends_immediately() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=8, delay_us=0))
    q.offer(req())
    assert sizes(take(q, 0)) == [1]


def test_rows_are_never_split() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=8))
    for rows in (3, 3, 3):
        q.offer(req(rows))
    out = take(q, 0)
    # 3+3 = 6; the third would make 9 > 8, so 6 goes now and 3 waits.
    assert sizes(out) == [6]
    assert [p.rows for p in out.batches[0].requests] == [3, 3]
    assert q.depth == 1


def test_too_many_rows_is_invalid() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=4))
    with pytest.raises(InvalidArgument, match="max_batch_size 4"):
        q.offer(req(5))


def test_preferred_size_goes_at_once() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=16, preferred=[4, 8]))
    for _ in range(3):
        q.offer(req())
    assert take(q, 0).batches == []
    q.offer(req())
    assert sizes(take(q, 0)) == [4]


def test_largest_reachable_preferred_size_wins() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=16, preferred=[4, 8]))
    for _ in range(9):
        q.offer(req())
    out = take(q, 0)
    # 9 waiting: 8 is reachable and no larger preferred size can form.
    assert sizes(out) == [8]
    assert q.depth == 1


def test_preferred_size_not_hit_exactly_sends_before_overshooting() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=16, preferred=[4]))
    q.offer(req(3))
    assert take(q, 0).batches == []
    q.offer(req(3))
    # 3+3 would pass the largest preferred size and 4 cannot form: send the 3.
    assert sizes(take(q, 0)) == [3]
    assert q.depth == 1


def test_delay_exceeded_sends_up_to_max_even_past_preferred() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=16, preferred=[4], delay_us=100))
    for rows in (3, 3):
        q.offer(req(rows))
    assert sizes(take(q, 100)) == [6]


def test_higher_priority_is_batched_first() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=4, levels=3, default_priority=2))
    low = [req(priority=3) for _ in range(3)]
    high = [req(priority=1, at_us=10) for _ in range(2)]
    for p in [*low, *high]:
        q.offer(p)
    out = take(q, 10)
    assert sizes(out) == [4]
    assert out.batches[0].requests == [*high, *low[:2]]
    assert q.depth == 1


def test_priority_header_mapping() -> None:
    q = ModelQueue("m", "1", make_config(levels=3, default_priority=2))
    assert q.priority_of(1) == 1
    assert q.priority_of(3) == 3
    assert q.priority_of(0) == 2
    assert q.priority_of(7) == 2


def test_different_shapes_never_share_a_batch() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=4, delay_us=100))
    a = [req(width=4) for _ in range(2)]
    b = [req(width=5) for _ in range(2)]
    for p in (a[0], b[0], a[1], b[1]):
        q.offer(p)
    out = take(q, 100)
    assert [b_.requests for b_ in out.batches] == [a, b]


def test_unbatched_model_sends_each_request_alone() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=0))
    for _ in range(3):
        q.offer(req(2))
    out = take(q, 0)
    assert [len(b.requests) for b in out.batches] == [1, 1, 1]


def test_full_queue_refuses_per_priority_level() -> None:
    q = ModelQueue("m", "7", make_config(max_queue_size=2, levels=2))
    q.offer(req(priority=1))
    q.offer(req(priority=1))
    with pytest.raises(ResourceExhausted) as info:
        q.offer(req(priority=1))
    assert info.value.reason == "queue-full"
    assert "'m'" in info.value.message
    assert "'7'" in info.value.message
    assert "max_queue_size 2" in info.value.message
    # Another level has its own bound.
    q.offer(req(priority=2))
    assert q.depth == 3


def test_expired_requests_leave_the_queue_and_never_batch() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=4, delay_us=5000))
    soon = req(deadline_ns=WALL0 + 2 * MS)
    later = req()
    q.offer(soon)
    q.offer(later)
    assert take(q, 0).batches == []
    # The wake time is the earlier of deadline and delay.
    assert q.wake_mono_ns == 2 * MS
    out = take(q, 2000)
    assert out.expired == [soon]
    assert out.batches == []
    assert q.depth == 1
    assert q.wake_mono_ns == 5 * MS
    out = take(q, 5000)
    assert [b.requests for b in out.batches] == [[later]]


def test_limit_leaves_ready_batches_queued() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=2))
    for _ in range(6):
        q.offer(req())
    out = take(q, 0, limit=1)
    assert sizes(out) == [2]
    assert out.limited
    out = take(q, 0, limit=10)
    assert sizes(out) == [2, 2]
    assert not out.limited


def test_flush_sends_everything() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=4, delay_us=10_000_000))
    for _ in range(6):
        q.offer(req())
    assert sizes(take(q, 0)) == [4]
    assert sizes(take(q, 1, flush=True)) == [2]
    assert q.depth == 0


def test_reconfigure_keeps_waiting_requests() -> None:
    q = ModelQueue("m", "1", make_config(max_batch_size=8, levels=1))
    q.offer(req())
    q.configure(make_config(max_batch_size=8, levels=3, delay_us=0))
    q.offer(req(priority=3))
    out = take(q, 0)
    assert sizes(out) == [2]
