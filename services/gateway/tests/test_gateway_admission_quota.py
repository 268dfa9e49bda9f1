"""Tenant quotas per UTC day and month against a real redis-server."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.errors import ResourceExhausted, Unavailable
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


def _future_day(days: int = 2) -> dt.datetime:
    """Midnight UTC a few days from now: Redis expiries use the real clock, so
    the fake wall clock must stay ahead of it whatever day the tests run."""
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today + dt.timedelta(days=days)


def _future_month_end() -> dt.datetime:
    """The first instant of a month at least a month from now (UTC)."""
    now = dt.datetime.now(dt.UTC)
    year, month = (now.year, now.month + 2) if now.month <= 10 else (now.year + 1, now.month - 10)
    return dt.datetime(year, month, 1, tzinfo=dt.UTC)


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
    day = _future_day()
    clock = WallClock(day + dt.timedelta(hours=15))
    await set_quota(client, KEYS, Quota("acme", per_day=3, per_month=100))
    keeper = QuotaKeeper(client, KEYS, wall_clock=clock, config_ttl_s=0)
    for _ in range(3):
        await keeper.check("acme")
    with pytest.raises(ResourceExhausted) as info:
        await keeper.check("acme")
    exc = info.value
    reset = day + dt.timedelta(days=1)
    assert exc.reason == "tenant-quota"
    assert "daily quota of 3 requests" in exc.message
    assert f"resets at {reset:%Y-%m-%dT%H:%M:%SZ}" in exc.message
    assert exc.retry_after_s == 9 * 3600
    # Refused requests do not count; other tenants are unaffected (no quota).
    assert await usage(client, KEYS, "acme", clock.now) == (3, 3)
    await keeper.check("globex")
    # The counter expires at the end of the day plus a grace hour (absolute time).
    key = KEYS.quota_count("acme", "d", f"{day:%Y%m%d}")
    expires = await client.execute_command("EXPIRETIME", key)
    assert expires == int((reset + dt.timedelta(hours=1)).timestamp())
    # Next day: counting starts again, the month goes on (unless it just ended).
    clock.now += dt.timedelta(days=1)
    await keeper.check("acme")
    same_month = clock.now.month == day.month
    assert await usage(client, KEYS, "acme", clock.now) == (1, 4 if same_month else 1)


async def test_monthly_quota_and_default_tenant(client: aioredis.Redis) -> None:
    month_end = _future_month_end()
    clock = WallClock(month_end - dt.timedelta(hours=1))
    await set_quota(client, KEYS, Quota("*", per_month=2))
    keeper = QuotaKeeper(client, KEYS, wall_clock=clock, config_ttl_s=0)
    await keeper.check("acme")
    await keeper.check("acme")
    with pytest.raises(ResourceExhausted) as info:
        await keeper.check("acme")
    assert "monthly quota of 2 requests" in info.value.message
    assert f"resets at {month_end:%Y-%m-%dT%H:%M:%SZ}" in info.value.message
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
