"""Retried requests with the same id and inputs are computed once; what is kept is
bounded in bytes and never pins a reply bundle."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.errors import Unavailable
from inferbus_common.sequences import SequenceFlags
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.dispatch.idempotency import ENTRY_OVERHEAD, IdempotencyCache, request_key


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


def _big(rid: str, values: np.ndarray, tenant: str = "") -> InferRequest:
    request = InferRequest("m", "", rid, [tensor_from_numpy("x", values)])
    request.tenant = tenant
    return request


class Counting:
    """A compute function that counts its calls and answers `outputs`."""

    def __init__(self, outputs: list[Tensor] | None = None) -> None:
        self.calls = 0
        self.outputs = outputs or []

    async def __call__(self) -> InferResponse:
        self.calls += 1
        return InferResponse("m", "1", "r", list(self.outputs))


async def test_a_reused_id_with_one_byte_changed_anywhere_is_a_new_request() -> None:
    # No sampling blind spot: the bytes are compared in full on a key match.
    cache = IdempotencyCache(window_s=10)
    compute = Counting()
    x = np.zeros((64, 1024), np.float32)
    await cache.run(_big("r1", x), compute)
    y = x.copy()
    y[31, 517] = 1e-30
    await cache.run(_big("r1", y), compute)
    assert compute.calls == 2
    # The retry of either matches (the latest answer for the key is kept).
    await cache.run(_big("r1", y.copy()), compute)
    assert compute.calls == 2


async def test_nan_inputs_match_byte_for_byte() -> None:
    cache = IdempotencyCache(window_s=10)
    compute = Counting()
    x = np.full((2, 4), np.nan, np.float32)
    await cache.run(_big("r1", x), compute)
    await cache.run(_big("r1", x.copy()), compute)
    assert compute.calls == 1


async def test_tenants_never_share_answers() -> None:
    cache = IdempotencyCache(window_s=10)
    compute = Counting()
    x = np.ones((1, 4), np.float32)
    await cache.run(_big("r1", x, tenant="a"), compute)
    await cache.run(_big("r1", x, tenant="b"), compute)
    await cache.run(_big("r1", x, tenant="a"), compute)
    assert compute.calls == 2


async def test_memory_is_bounded_in_bytes() -> None:
    row = np.ones((1, 1024), np.float32)  # 4 KiB of input per request
    per_entry = ENTRY_OVERHEAD + row.nbytes
    cache = IdempotencyCache(window_s=10, max_bytes=3 * per_entry)
    compute = Counting()
    for i in range(10):
        await cache.run(_big(f"r{i}", row), compute)
    assert cache.kept == (3, 3 * per_entry)
    # The oldest went first: r9 replays, r0 is computed again.
    await cache.run(_big("r9", row), compute)
    assert compute.calls == 10
    await cache.run(_big("r0", row), compute)
    assert compute.calls == 11


async def test_an_answer_over_the_entry_bound_is_not_kept_but_joins() -> None:
    cache = IdempotencyCache(window_s=10, max_entry_bytes=1024)
    gate = asyncio.Event()
    calls = 0

    async def slow() -> InferResponse:
        nonlocal calls
        calls += 1
        await gate.wait()
        return InferResponse("m", "1", "r", [])

    big = np.ones((1, 1024), np.float32)
    first = asyncio.create_task(cache.run(_big("r1", big), slow))
    second = asyncio.create_task(cache.run(_big("r1", big), slow))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(first, second)
    assert calls == 1 and cache.kept == (0, 0)


async def test_expired_answers_free_their_bytes() -> None:
    clock = Clock()
    cache = IdempotencyCache(window_s=10, clock=clock)
    compute = Counting()
    await cache.run(_big("r1", np.ones((1, 4), np.float32)), compute)
    assert cache.kept[0] == 1
    clock.now = 11
    await cache.run(_big("r2", np.ones((1, 4), np.float32)), compute)
    assert cache.kept == (1, ENTRY_OVERHEAD + 16)


async def test_kept_answers_do_not_pin_the_reply_bundle() -> None:
    bundle = np.arange(4096, dtype=np.uint8)  # stands for a reply bundle's buffer
    alive = weakref.ref(bundle)
    output = Tensor("y", "UINT8", (1, 16), memoryview(bundle)[100:116])
    compute = Counting([output])
    cache = IdempotencyCache(window_s=10)
    first = await cache.run(_big("r1", np.ones((1, 4), np.float32)), compute)
    assert bytes(first.outputs[0].data) == bytes(range(100, 116))
    del bundle, output, first, compute
    gc.collect()
    assert alive() is None
    replay = await cache.run(_big("r1", np.ones((1, 4), np.float32)), Counting())
    assert bytes(replay.outputs[0].data) == bytes(range(100, 116))
