"""`Admission` built from gateway settings, against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.admission.limits import Limit, Scope, set_limit
from inferbus_common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from inferbus_gateway.admission.breaker import BreakerOpen, counts_as_failure
from inferbus_gateway.admission.control import Admission
from inferbus_gateway.admission.quota import Quota, set_quota
from inferbus_gateway.settings import GatewaySettings
from inferbus_testing.servers import RedisServer


def settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(_env_file=None, **kw)  # type: ignore[call-arg]


async def test_admit_runs_every_check_in_order(redis_server: RedisServer) -> None:
    s = settings(
        redis_url=redis_server.url,
        redis_key_prefix="ctl",
        auth_enabled=True,
        auth_tenant_models={"acme": ["fraud"]},
        breaker_min_requests=2,
    )
    keys = AdmissionKeys("ctl")
    admin = connect_redis(redis_server.url)
    _, key = await KeyStore(admin, keys).create_key("acme")
    await set_limit(admin, keys, Limit(Scope.TENANT_MODEL, "acme:fraud", 4, burst=4))
    await set_quota(admin, keys, Quota("acme", per_day=3))
    await admin.aclose()
    async with Admission.from_settings(s, "gw-test") as adm:
        with pytest.raises(Unauthenticated):
            await adm.admit({}, model="fraud")
        with pytest.raises(PermissionDenied):
            await adm.admit({"x-api-key": key}, model="churn")
        for _ in range(3):
            p = await adm.admit({"x-api-key": key}, model="fraud")
            assert p.tenant == "acme"
            adm.record("fraud", None)
        with pytest.raises(ResourceExhausted) as info:
            await adm.admit({"x-api-key": key}, model="fraud")
        assert info.value.reason == "tenant-quota" and "daily quota" in info.value.message
        with pytest.raises(ResourceExhausted) as info:
            await adm.admit({"x-api-key": key}, model="fraud")
        assert "limited to 4 requests/s" in info.value.message
        # 3 failures after 3 successes reach the 50 % failure rate: the breaker opens,
        # and then refuses before any limit or quota is consulted.
        for _ in range(3):
            adm.record("fraud", DeadlineExceeded("late"))
        with pytest.raises(BreakerOpen) as opened:
            await adm.admit({"x-api-key": key}, model="fraud")
        assert opened.value.model == "fraud" and opened.value.retry_after_s > 0


async def test_without_redis_only_breakers_and_jwt() -> None:
    async with Admission.from_settings(settings(), "gw") as adm:
        assert adm.limiter is None and adm.quotas is None
        p = await adm.admit({}, model="anything")
        assert p.method == "none"
    with pytest.raises(ValueError, match="auth is enabled"):
        async with Admission.from_settings(settings(auth_enabled=True), "gw"):
            pass


def test_outcomes_that_do_not_count() -> None:
    assert counts_as_failure(asyncio.CancelledError()) is None
    assert counts_as_failure(InvalidArgument("x")) is None
    assert counts_as_failure(BreakerOpen("open", model="m", retry_after_s=1)) is None
