"""Tenant quotas per UTC day and month against a real redis-server."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from inferbus_common.errors import ResourceExhausted, Unavailable
from inferbus_gateway.admission._redis import AdmissionKeys, connect_redis
from inferbus_gateway.admission.quota import (
    Periods,
    Quota,
    QuotaKeeper,
    delete_quota,
    list_quotas,
    set_quota,
    usage,
)
from inferbus_testing.servers import RedisServer

KEYS = AdmissionKeys("t")


class WallClock:
    """A UTC wall clock set by the test."""

    def __init__(self, when: dt.datetime) -> None:
        self.now = when

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = connect_redis(redis_server.url)
    try:
        yield c
    finally:
        await c.aclose()


def test_periods_roll_over_at_utc_boundaries() -> None:
    p = Periods.at(dt.datetime(2026, 12, 31, 23, 59, 59, tzinfo=dt.UTC))
    assert (p.day, p.month) == ("20261231", "202612")
    assert p.day_end == dt.datetime(2027, 1, 1, tzinfo=dt.UTC) == p.month_end
    local = dt.datetime(2026, 2, 28, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-2)))
    p = Periods.at(local)  # 01:30 UTC on 1 March
    assert (p.day, p.month) == ("20260301", "202603")
    assert p.month_end == dt.datetime(2026, 4, 1, tzinfo=dt.UTC)


async def test_daily_quota_names_the_reset_time(client: aioredis.Redis) -> None:
    clock = WallClock(dt.datetime(2026, 12, 2, 15, 0, 0, tzinfo=dt.UTC))
    await set_quota(client, KEYS, Quota("acme", per_day=3, per_month=100))
    keeper = QuotaKeeper(client, KEYS, wall_clock=clock, config_ttl_s=0)
    for _ in range(3):
        await keeper.check("acme")
    with pytest.raises(ResourceExhausted) as info:
        await keeper.check("acme")
    exc = info.value
    assert exc.reason == "tenant-quota"
    assert "daily quota of 3 requests" in exc.message
    assert "resets at 2026-12-03T00:00:00Z" in exc.message
    assert exc.retry_after_s == 9 * 3600
    # Refused requests do not count; other tenants are unaffected (no quota).
    assert await usage(client, KEYS, "acme", clock.now) == (3, 3)
    await keeper.check("globex")
    # The counter expires at the end of the day (plus a grace hour).
    ttl = await client.ttl(KEYS.quota_count("acme", "d", "20261202"))
    assert 9 * 3600 < ttl <= 10 * 3600
    # Next day: counting starts again, the month goes on.
    clock.now += dt.timedelta(days=1)
    await keeper.check("acme")
    assert await usage(client, KEYS, "acme", clock.now) == (1, 4)


async def test_monthly_quota_and_default_tenant(client: aioredis.Redis) -> None:
    clock = WallClock(dt.datetime(2026, 12, 31, 23, 0, 0, tzinfo=dt.UTC))
    await set_quota(client, KEYS, Quota("*", per_month=2))
    keeper = QuotaKeeper(client, KEYS, wall_clock=clock, config_ttl_s=0)
    await keeper.check("acme")
    await keeper.check("acme")
    with pytest.raises(ResourceExhausted) as info:
        await keeper.check("acme")
    assert "monthly quota of 2 requests" in info.value.message
    assert "resets at 2027-01-01T00:00:00Z" in info.value.message
    assert info.value.retry_after_s == 3600
    await keeper.check("globex")  # its own counters under the default quota
    # Run-time change: a tenant's own entry overrides the default.
    await set_quota(client, KEYS, Quota("acme", per_month=10))
    await keeper.check("acme")
    assert [q.tenant for q in await list_quotas(client, KEYS)] == ["*", "acme"]
    assert await delete_quota(client, KEYS, "acme")


async def test_redis_down_fail_open_and_closed(
    client: aioredis.Redis, redis_server: RedisServer
) -> None:
    await set_quota(client, KEYS, Quota("acme", per_day=1))
    clock = [0.0]
    open_keeper = QuotaKeeper(client, KEYS, config_ttl_s=0, clock=lambda: clock[0])
    closed_keeper = QuotaKeeper(
        client, KEYS, failure_mode="fail-closed", config_ttl_s=0, clock=lambda: clock[0]
    )
    await open_keeper.check("acme")
    redis_server.kill()
    await open_keeper.check("acme")  # admitted, uncounted
    assert open_keeper.degraded
    with pytest.raises(Unavailable):
        await closed_keeper.check("acme")
    await redis_server.arestart()
    await set_quota(client, KEYS, Quota("acme", per_day=1))
    # Within the retry interval Redis is not asked again: the failure mode holds.
    clock[0] += 0.4
    await open_keeper.check("acme")
    assert open_keeper.degraded
    with pytest.raises(Unavailable):
        await closed_keeper.check("acme")
    clock[0] += 0.1
    await open_keeper.check("acme")
    assert not open_keeper.degraded
    with pytest.raises(ResourceExhausted):
        await closed_keeper.check("acme")
    assert not closed_keeper.degraded
