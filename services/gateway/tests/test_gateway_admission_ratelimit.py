"""Cluster QPS limiter against a real redis-server: accuracy, cost, Redis failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import REGISTRY

from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.admission.limits import Limit, Scope, delete_limit, list_limits, set_limit
from inferbus_common.errors import ResourceExhausted, Unavailable
from inferbus_gateway.admission.ratelimit import FailureMode, RateLimiter, TokenBucket
from inferbus_testing.servers import RedisServer

KEYS = AdmissionKeys("t")
DEGRADED_METRIC = "inferbus_gateway_ratelimit_degraded"


@contextlib.asynccontextmanager
async def limiters(
    url: str,
    n: int,
    *,
    mode: FailureMode = "fail-open",
    redis_timeout_s: float = 0.25,
    **kwargs: object,
) -> AsyncIterator[list[RateLimiter]]:
    """`n` limiters, each with its own Redis client, as `n` gateways would have."""
    clients = [connect_redis(url, timeout_s=redis_timeout_s) for _ in range(n)]
    try:
        async with contextlib.AsyncExitStack() as stack:
            out = []
            for i, client in enumerate(clients):
                rl = RateLimiter(
                    client,
                    KEYS,
                    instance_id=f"gw-{i}",
                    failure_mode=mode,
                    reload_interval_s=0.1,
                    **kwargs,  # type: ignore[arg-type]
                )
                out.append(await stack.enter_async_context(rl))
            yield out
    finally:
        for client in clients:
            await client.aclose()


class Tally:
    """What one load generator saw."""

    def __init__(self) -> None:
        self.admitted = 0
        self.admitted_at: list[float] = []
        self.rejected: list[BaseException] = []
        self.attempted_at: list[float] = []

    def admitted_since(self, t: float) -> int:
        """Admissions at or after monotonic time `t`."""
        return sum(1 for a in self.admitted_at if a >= t)

    def stalled_s(self, since: float, full_after_s: float) -> float:
        """Seconds after `since` in which this generator asked for nothing although its
        bucket was already full: the gaps between consecutive calls, less the
        `full_after_s` a drained bucket takes to fill. A token bucket forgets what
        refills past its capacity, so a generator stalled that long (a loop blocked by
        a loaded machine) is offered less than the rate by that much."""
        times = [t for t in self.attempted_at if t >= since]
        return sum(
            max(0.0, b - a - full_after_s) for a, b in zip([since, *times], times, strict=False)
        )


async def offer(
    limiter: RateLimiter, model: str, rate: float, duration_s: float, tenant: str = "acme"
) -> Tally:
    """Call acquire() `rate` times a second for `duration_s` (open loop, fixed schedule)."""
    tally = Tally()
    interval = 1.0 / rate
    t0 = time.monotonic()
    n = 0
    while True:
        # Count from n, not from (t0 + n * interval) - t0: that difference rounds
        # to either side of duration_s depending on t0, one call more or less.
        if n * interval >= duration_s:
            return tally
        due = t0 + n * interval
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        n += 1
        tally.attempted_at.append(time.monotonic())
        try:
            await limiter.acquire(interface="ModelInfer", model=model, tenant=tenant)
            tally.admitted += 1
            tally.admitted_at.append(time.monotonic())
        except (ResourceExhausted, Unavailable) as exc:
            tally.rejected.append(exc)


async def wait_for(cond: object, timeout: float = 5.0) -> None:
    """Poll `cond()` until true (never a blind sleep)."""
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def total(tallies: Sequence[Tally]) -> int:
    return sum(t.admitted for t in tallies)


def ideal_admissions(
    tallies: Sequence[Tally], rate: float, capacity: float, start: float, since: float
) -> int:
    """What one ideal token bucket (full at `start`) admits at or after `since` of the
    calls the generators actually made, at the times they made them. A generator
    stalled by a loaded machine (its loop, or a Redis round trip) asks for less than
    its schedule, and a bucket forgets refills past its capacity: this is the figure
    a perfect cluster limiter would reach for that same offered load."""
    tokens, last, admitted = capacity, start, 0
    for t in sorted(a for tally in tallies for a in tally.attempted_at):
        tokens = min(capacity, tokens + (t - last) * rate)
        last = t
        if tokens >= 1:
            tokens -= 1
            admitted += t >= since
    return admitted


async def test_three_gateways_hold_the_cluster_limit(redis_server: RedisServer) -> None:
    admin = connect_redis(redis_server.url)
    limit = Limit(Scope.MODEL, "fraud", 200)
    await set_limit(admin, KEYS, limit)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "other", 1000))
    await set_limit(admin, KEYS, Limit(Scope.INTERFACE, "ModelInfer", 100_000))
    warmup, measured = 0.5, 2.5
    # Accuracy, not Redis outages: a loaded CI machine can stall a Redis round trip
    # past the gateway's 0.25 s, which falls open (tested on its own below).
    async with limiters(redis_server.url, 3, redis_timeout_s=5.0) as gws:
        # 2x the limit in total, split over three gateways; a second model alongside.
        # The first half second drains the bucket's initial burst and is not measured.
        start = time.monotonic()
        results = await asyncio.gather(
            *(offer(gw, "fraud", 400 / 3, warmup + measured) for gw in gws),
            *(offer(gw, "other", 50, warmup + measured) for gw in gws),
        )
    await admin.aclose()
    fraud, other = results[:3], results[3:]
    since = start + warmup
    # To the last call: a generator that fell behind catches up past its schedule.
    window = max(t.attempted_at[-1] for t in fraud) - since
    admitted = sum(t.admitted_since(since) for t in fraud)
    # The bucket's own capacity (20: two leases of 10), full again 0.1 s after a drain.
    ideal = ideal_admissions(fraud, limit.qps, limit.capacity, start, since)
    detail = (admitted, ideal, round(window, 3), [t.admitted for t in fraud])
    print(f"\nadmitted {admitted / window:.1f}/s for a limit of 200/s, ideal bucket {ideal}")
    # Never over the limit; under it by at most 10 % of what an ideal bucket would
    # admit of the calls actually made. Leases (10 tokens, expiring after 0.2 s)
    # lose some tokens when Redis stalls: with redis-server stopped 0.3 s of every
    # 0.8 s it was 0.92 of the ideal; CI's loaded machine once gave 0.944 of 200/s.
    assert admitted <= 200 * window * 1.05 + 1, detail
    assert admitted >= ideal * 0.90, detail
    rejections = [e for t in fraud for e in t.rejected]
    assert rejections, "2x the limit must be partly rejected"
    for exc in rejections:
        assert isinstance(exc, ResourceExhausted)
        assert exc.reason == "model-qps", (exc.message, exc.retry_after_s)
        assert "model 'fraud' is limited to 200 requests/s (strategy: model-qps)" in exc.message
        assert exc.retry_after_s > 0
    assert all(not t.rejected for t in other)
    assert total(other) == 3 * int(50 * (warmup + measured))


async def test_tenant_and_interface_scopes(redis_server: RedisServer) -> None:
    admin = connect_redis(redis_server.url)
    await set_limit(admin, KEYS, Limit(Scope.TENANT_MODEL, "*:fraud", 5, burst=5))
    await set_limit(admin, KEYS, Limit(Scope.INTERFACE, "ModelMetadata", 3, burst=3))
    async with limiters(redis_server.url, 1) as (gw,):
        for _ in range(5):
            await gw.acquire(interface="ModelInfer", model="fraud", tenant="acme")
        with pytest.raises(ResourceExhausted) as info:
            await gw.acquire(interface="ModelInfer", model="fraud", tenant="acme")
        assert info.value.reason == "tenant-quota"
        assert "tenant 'acme' is limited to 5 requests/s on model 'fraud'" in info.value.message
        # Each tenant has its own bucket under the wildcard limit.
        await gw.acquire(interface="ModelInfer", model="fraud", tenant="globex")
        for _ in range(3):
            await gw.acquire(interface="ModelMetadata", model="x", tenant="acme")
        with pytest.raises(ResourceExhausted) as info:
            await gw.acquire(interface="ModelMetadata", model="x", tenant="acme")
        assert info.value.reason == "cluster-qps"
        assert "interface 'ModelMetadata'" in info.value.message
    await admin.aclose()


async def test_instance_limit_is_local() -> None:
    rl = RateLimiter(connect_redis("redis://127.0.0.1:1/0"), KEYS, instance_id="x", instance_qps=2)
    # No `async with`: no limits configured, so Redis is never asked.
    await rl.acquire(interface="ModelInfer", model="m")
    with pytest.raises(ResourceExhausted) as info:
        await rl.acquire(interface="ModelInfer", model="m")
    assert info.value.reason == "instance-qps"
    assert "this gateway instance is limited to 2 requests/s" in info.value.message


def test_token_bucket_with_injected_clock() -> None:
    now = [100.0]
    bucket = TokenBucket(4, 2, clock=lambda: now[0])
    assert bucket.try_take() and bucket.try_take()
    assert not bucket.try_take()
    assert bucket.wait_s() == pytest.approx(0.25)
    now[0] += 0.25
    assert bucket.try_take()
    now[0] += 10
    assert bucket.tokens <= 2 and bucket.try_take() and bucket.try_take()
    assert not bucket.try_take()


async def test_limits_change_at_run_time_and_list(redis_server: RedisServer) -> None:
    admin = connect_redis(redis_server.url)
    async with limiters(redis_server.url, 1) as (gw,):
        await gw.acquire(interface="ModelInfer", model="fraud")  # unlimited
        await set_limit(admin, KEYS, Limit(Scope.MODEL, "fraud", 1, burst=1))
        await wait_for(lambda: "model:fraud" in gw.limits, timeout=1.0)
        await gw.acquire(interface="ModelInfer", model="fraud")
        with pytest.raises(ResourceExhausted):
            await gw.acquire(interface="ModelInfer", model="fraud")
        assert [lim.field for lim in await list_limits(admin, KEYS)] == ["model:fraud"]
        assert await delete_limit(admin, KEYS, Scope.MODEL, "fraud")
        await wait_for(lambda: not gw.limits, timeout=1.0)
        await gw.acquire(interface="ModelInfer", model="fraud")
        assert await admin.zscore(KEYS.gateways, "gw-0") is not None
    # A gateway that stops deregisters at once instead of waiting for its TTL.
    assert await admin.zscore(KEYS.gateways, "gw-0") is None
    await admin.aclose()


async def test_lease_cost_per_acquire(redis_server: RedisServer) -> None:
    admin = connect_redis(redis_server.url)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "fraud", 1_000_000))
    await set_limit(admin, KEYS, Limit(Scope.TENANT_MODEL, "acme:fraud", 1_000_000))
    async with limiters(redis_server.url, 1) as (gw,):
        # Best of several rounds: the CI machine's other load is not the limiter's cost.
        rounds, rtts = [], []
        for _ in range(5):
            n = 1000
            t0 = time.perf_counter()
            for _ in range(n):
                await gw.acquire(interface="ModelInfer", model="fraud", tenant="acme")
            rounds.append((time.perf_counter() - t0) / n * 1e6)
            t0 = time.perf_counter()
            for _ in range(100):
                await admin.ping()
            rtts.append((time.perf_counter() - t0) / 100 * 1e6)
    await admin.aclose()
    per_call_us, rtt_us = min(rounds), min(rtts)
    print(
        f"\nadded time per acquire() (2 scopes, leases of 10): best {per_call_us:.1f} µs, "
        f"mean {sum(rounds) / len(rounds):.1f} µs; one Redis round trip: {rtt_us:.1f} µs"
    )
    # Well under 100 µs on a quiet machine. On a machine so loaded that one Redis round
    # trip alone takes over 200 µs, check what leases are for instead: a request costs
    # well under the round trip it would cost without them.
    assert per_call_us < max(100.0, rtt_us / 2)


async def test_leases_are_fetched_ahead(redis_server: RedisServer) -> None:
    admin = connect_redis(redis_server.url)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "fraud", 1_000_000))
    await set_limit(admin, KEYS, Limit(Scope.TENANT_MODEL, "acme:fraud", 1_000_000))
    await admin.aclose()
    waits = "inferbus_gateway_ratelimit_request_waits_total"
    calls = "inferbus_gateway_ratelimit_redis_calls_total"
    async with limiters(redis_server.url, 1) as (gw,):
        waits0, calls0 = REGISTRY.get_sample_value(waits), REGISTRY.get_sample_value(calls)
        for _ in range(100):
            await gw.acquire(interface="ModelInfer", model="fraud", tenant="acme")
            # Between requests the event loop is free, as in a gateway: the next lease
            # (both scopes in one call) arrives before this one is spent.
            await wait_for(lambda: not gw._refills)
        # Only the very first request waited for Redis; 1 call per 10 requests.
        assert REGISTRY.get_sample_value(waits) - waits0 == 1  # type: ignore[operator]
        assert REGISTRY.get_sample_value(calls) - calls0 <= 100 / 10 + 1  # type: ignore[operator]


async def test_fail_open_holds_per_instance_limits_and_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = connect_redis(redis_server.url)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "fraud", 90))
    await admin.aclose()
    async with limiters(redis_server.url, 3) as gws:
        await wait_for(lambda: all(gw.live_gateways == 3 for gw in gws))
        redis_server.kill()
        with caplog.at_level(logging.INFO, logger="inferbus_gateway.admission.ratelimit"):
            duration = 1.0
            tallies = await asyncio.gather(*(offer(gw, "fraud", 60, duration) for gw in gws))
            assert all(gw.degraded for gw in gws)
            assert REGISTRY.get_sample_value(DEGRADED_METRIC, {"mode": "fail-open"}) == 1
            # Each gateway holds 90/3 = 30/s (+ its 1/3 share of the burst).
            for t in tallies:
                assert abs(t.admitted / duration - 30) <= 30 * 0.1 + 2, t.admitted
                assert {e.reason for e in t.rejected} == {"model-qps"}  # type: ignore[attr-defined]
            assert "1/3 of it" in str(tallies[0].rejected[0])
            # Redis comes back empty (no persistence): limits last seen stay in force.
            await redis_server.arestart()
            await wait_for(lambda: not any(gw.degraded for gw in gws))
            assert REGISTRY.get_sample_value(DEGRADED_METRIC, {"mode": "fail-open"}) == 0
        transitions = [r.getMessage() for r in caplog.records]
        assert sum("fail-open" in m for m in transitions) == 3
        assert sum("restored" in m for m in transitions) == 3
        # Cluster limit again: one gateway alone may now use all 90/s.
        start = time.monotonic()
        alone = await offer(gws[0], "fraud", 180, 0.3 + duration)
        # After the bucket's burst, to the last call (a generator that fell behind
        # catches up after its schedule's end): at most 90/s, and at least 90/s of
        # the time the generator was not stalled past the bucket's fill time
        # (capacity 9 tokens at 90/s: 0.1 s), which a loaded 2-core machine causes.
        since = start + 0.3
        window = alone.attempted_at[-1] - since
        stalled = alone.stalled_s(since, 9 / 90)
        admitted = alone.admitted_since(since)
        detail = (admitted, round(window, 3), round(stalled, 3), alone.admitted)
        assert admitted <= 90 * window * 1.07 + 1, detail
        assert admitted >= 90 * (window - stalled) * 0.93, detail


async def test_fail_closed_rejects_with_unavailable(redis_server: RedisServer) -> None:
    admin = connect_redis(redis_server.url)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "fraud", 1000))
    await admin.aclose()
    async with limiters(redis_server.url, 1, mode="fail-closed") as (gw,):
        await gw.acquire(interface="ModelInfer", model="fraud")
        redis_server.kill()
        await wait_for(lambda: gw.degraded)
        with pytest.raises(Unavailable):
            await gw.acquire(interface="ModelInfer", model="fraud")
        # A model without limits never needs Redis.
        await gw.acquire(interface="ModelInfer", model="free")
        await redis_server.arestart()
        await wait_for(lambda: not gw.degraded)
        await gw.acquire(interface="ModelInfer", model="fraud")
