"""Retried requests with the same id and inputs are computed once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import Unavailable
from inferbus_common.sequences import SequenceFlags
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.idempotency import IdempotencyCache, request_key


def _request(rid: str, value: float) -> InferRequest:
    x = np.full((1, 4), value, dtype=np.float32)
    return InferRequest("m", "", rid, [tensor_from_numpy("x", x)])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_retry_replays_and_concurrent_retry_joins() -> None:
    clock = Clock()
    cache = IdempotencyCache(window_s=10, clock=clock)
    calls = 0
    gate = asyncio.Event()

    async def compute() -> InferResponse:
        nonlocal calls
        calls += 1
        await gate.wait()
        return InferResponse("m", "1", "r1", [])

    first = asyncio.create_task(cache.run(_request("r1", 1.0), compute))
    second = asyncio.create_task(cache.run(_request("r1", 1.0), compute))
    await asyncio.sleep(0)
    gate.set()
    a, b = await asyncio.gather(first, second)
    assert a == b and calls == 1
    assert await cache.run(_request("r1", 1.0), compute) == a and calls == 1
    clock.now = 11
    await cache.run(_request("r1", 1.0), compute)
    assert calls == 2


async def test_a_replay_is_not_changed_by_what_the_first_caller_did_to_its_answer() -> None:
    # The steps after the cache replace outputs in place (classification): a
    # retry must get the model's answer, not one classified already.
    cache = IdempotencyCache(window_s=10)
    y = tensor_from_numpy("y", np.arange(4, dtype=np.float32).reshape(1, 4))

    async def compute() -> InferResponse:
        return InferResponse("m", "1", "r1", [y])

    first = await cache.run(_request("r1", 1.0), compute)
    first.outputs[0] = tensor_from_numpy("y", np.array([[b"3.0:3"]], dtype=object))
    first.timings_ms["total"] = 1.0
    again = await cache.run(_request("r1", 1.0), compute)
    assert again.outputs == [y] and again.timings_ms == {}
    again.outputs.clear()
    assert (await cache.run(_request("r1", 1.0), compute)).outputs == [y]


async def test_same_id_different_inputs_or_no_id_is_computed() -> None:
    cache = IdempotencyCache(window_s=10)
    calls = 0

    async def compute() -> InferResponse:
        nonlocal calls
        calls += 1
        return InferResponse("m", "1", "x", [])

    await cache.run(_request("r1", 1.0), compute)
    await cache.run(_request("r1", 2.0), compute)
    await cache.run(_request("", 1.0), compute)
    await cache.run(_request("", 1.0), compute)
    assert calls == 4


async def test_errors_are_not_cached() -> None:
    cache = IdempotencyCache(window_s=10)
    calls = 0

    async def failing() -> InferResponse:
        nonlocal calls
        calls += 1
        raise Unavailable("down")

    for _ in range(2):
        with pytest.raises(Unavailable):
            await cache.run(_request("r1", 1.0), failing)
    assert calls == 2


def test_requests_of_different_sequences_or_steps_are_different_requests() -> None:
    def keyed(flags: SequenceFlags | None) -> str:
        request = _request("same-id", 1.0)
        request.sequence = flags
        return request_key(request)

    keys = {
        keyed(None),
        keyed(SequenceFlags(1, start=True)),
        keyed(SequenceFlags(1)),
        keyed(SequenceFlags("1")),
        keyed(SequenceFlags(2)),
    }
    assert len(keys) == 5
    assert keyed(SequenceFlags(1)) == keyed(SequenceFlags(1))
