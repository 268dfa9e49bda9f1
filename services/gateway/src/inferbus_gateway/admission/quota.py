"""Per-tenant request quotas per UTC day and per UTC month, counted in Redis.

Quotas are configured in the hash ``<prefix>:quotas``: field = tenant (or
``*`` for every tenant without its own), value = JSON ``{"per_day": N,
"per_month": M}`` (0 or missing = no quota for that period). Gateways re-read a
tenant's quota at most every `config_ttl_s` (≤ 1 s), so changes need no
restart, and a tenant without a quota costs no Redis call at all.

Counting is one atomic Lua script per request of a tenant with a quota: it
refuses when a period's count has reached its quota and otherwise increments
both counters, each of which expires when its period ends (``EXPIREAT``), so a
refused request never uses up quota. Counter keys of a tenant share the hash
tag ``{<prefix>:quota:<tenant>}``, which keeps the script valid on a Redis
Cluster.

Calendar periods need the wall clock (UTC); gateways' clocks are assumed to
agree to well within a second (NTP).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from typing import Literal

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge

from inferbus_common.admission.keys import (
    REDIS_DOWN_ERRORS,
    AdmissionKeys,
    reraise_if_cancelling,
)
from inferbus_common.errors import ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

QUOTA_REJECTED = Counter(
    "inferbus_gateway_quota_rejected_total",
    "Requests refused because a tenant's quota was used up, by period.",
    ["period"],
)
QUOTA_DEGRADED = Gauge(
    "inferbus_gateway_quota_degraded",
    "1 while Redis is unreachable and quotas run in their failure mode, else 0.",
    ["mode"],
)

MAX_CONFIG_TTL_S = 1.0
#: Counters outlive their period a little, so a gateway whose clock lags at the
#: boundary never recreates a counter without an expiry.
_EXPIRY_GRACE_S = 3600

# KEYS: day counter, month counter. ARGV: per_day, per_month, day expiry, month expiry
# (unix s). Returns {0 | 1 (day full) | 2 (month full), day count, month count}.
_COUNT_SCRIPT = """
local pd = tonumber(ARGV[1])
local pm = tonumber(ARGV[2])
local d = tonumber(redis.call('GET', KEYS[1]) or '0')
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
if pd > 0 and d >= pd then return {1, d, m} end
if pm > 0 and m >= pm then return {2, d, m} end
d = redis.call('INCR', KEYS[1])
redis.call('EXPIREAT', KEYS[1], ARGV[3])
m = redis.call('INCR', KEYS[2])
redis.call('EXPIREAT', KEYS[2], ARGV[4])
return {0, d, m}
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's quota; 0 = unlimited for that period."""

    tenant: str
    per_day: int = 0
    per_month: int = 0

    def to_json(self) -> str:
        """The hash value stored in Redis."""
        return json.dumps({"per_day": self.per_day, "per_month": self.per_month})

    @classmethod
    def parse(cls, tenant: str, raw: bytes | str) -> Quota:
        """Parse a stored value.

        Raises:
            ValueError: malformed value.
        """
        data = json.loads(raw)
        quota = cls(tenant, int(data.get("per_day") or 0), int(data.get("per_month") or 0))
        if quota.per_day < 0 or quota.per_month < 0:
            raise ValueError("quotas must be >= 0")
        return quota

    @property
    def active(self) -> bool:
        """True when either period has a quota."""
        return self.per_day > 0 or self.per_month > 0


@dataclasses.dataclass(frozen=True, slots=True)
class Periods:
    """The current UTC day and month: counter stamps and when each ends."""

    day: str
    month: str
    day_end: dt.datetime
    month_end: dt.datetime

    @classmethod
    def at(cls, now: dt.datetime) -> Periods:
        """The periods `now` (timezone-aware) falls in."""
        now = now.astimezone(dt.UTC)
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        day_end = start + dt.timedelta(days=1)
        first = start.replace(day=1)
        month_end = (first + dt.timedelta(days=32)).replace(day=1)
        return cls(now.strftime("%Y%m%d"), now.strftime("%Y%m"), day_end, month_end)


def _iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


# --- administration (used by a future `inferbus quotas`) --------------------------


async def set_quota(redis: aioredis.Redis, keys: AdmissionKeys, quota: Quota) -> None:
    """Create or change a tenant's quota (``*`` = default for every tenant)."""
    await redis.hset(keys.quotas, quota.tenant, quota.to_json())


async def delete_quota(redis: aioredis.Redis, keys: AdmissionKeys, tenant: str) -> bool:
    """Remove a tenant's quota; True when it existed."""
    return bool(await redis.hdel(keys.quotas, tenant))


async def list_quotas(redis: aioredis.Redis, keys: AdmissionKeys) -> list[Quota]:
    """Every configured quota, sorted by tenant."""
    raw = await redis.hgetall(keys.quotas)
    # The client returns bytes (no decode_responses); its type also allows str.
    quotas = (Quota.parse(k.decode() if isinstance(k, bytes) else k, v) for k, v in raw.items())
    return sorted(quotas, key=lambda q: q.tenant)


async def usage(
    redis: aioredis.Redis, keys: AdmissionKeys, tenant: str, now: dt.datetime | None = None
) -> tuple[int, int]:
    """Requests `tenant` made in the current UTC day and month."""
    p = Periods.at(now or dt.datetime.now(dt.UTC))
    d, m = await redis.mget(
        keys.quota_count(tenant, "d", p.day), keys.quota_count(tenant, "m", p.month)
    )
    return int(d or 0), int(m or 0)


class QuotaKeeper:
    """Counts each tenant's requests and refuses them beyond its quota.

    Args:
        redis: client (see `connect_redis`).
        keys: Redis key names.
        failure_mode: while Redis is unreachable, ``fail-open`` admits (uncounted)
            and ``fail-closed`` answers UNAVAILABLE.
        config_ttl_s: how long a tenant's quota is reused before re-reading (≤ 1 s).
        wall_clock: current time, timezone-aware (injectable for tests).
        clock: monotonic clock for the config cache.
        retry_interval_s: after a Redis failure, how long requests apply the failure
            mode without trying Redis again.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: AdmissionKeys,
        *,
        failure_mode: Literal["fail-open", "fail-closed"] = "fail-open",
        config_ttl_s: float = MAX_CONFIG_TTL_S,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        clock: Callable[[], float] = time.monotonic,
        retry_interval_s: float = 0.5,
    ) -> None:
        if not 0 <= config_ttl_s <= MAX_CONFIG_TTL_S:
            raise ValueError(f"config_ttl_s must be within [0, {MAX_CONFIG_TTL_S}]")
        self._redis = redis
        self._keys = keys
        self.failure_mode = failure_mode
        QUOTA_DEGRADED.labels(failure_mode).set(0)  # exported (0) before any outage, for alerts
        self._ttl = config_ttl_s
        self._wall_clock = wall_clock
        self._clock = clock
        self._script = redis.register_script(_COUNT_SCRIPT)
        self._config: dict[str, tuple[float, Quota | None]] = {}
        self._retry_interval_s = retry_interval_s
        self._retry_at = 0.0
        self.degraded = False
        """True while Redis is unreachable."""

    def _set_degraded(self, degraded: bool, exc: BaseException | None = None) -> None:
        if degraded == self.degraded:
            return
        self.degraded = degraded
        QUOTA_DEGRADED.labels(self.failure_mode).set(1 if degraded else 0)
        if degraded:
            log.warning(
                "tenant quotas cannot reach Redis (%s); %s",
                type(exc).__name__,
                "admitting requests uncounted (fail-open)"
                if self.failure_mode == "fail-open"
                else "refusing requests of tenants with a quota (fail-closed)",
            )
        else:
            log.info("tenant quotas reached Redis again; counting resumed")

    def _redis_down(self) -> None:
        if self.failure_mode == "fail-closed":
            raise Unavailable(
                "tenant quotas cannot be checked right now (Redis unreachable); retry shortly"
            )

    async def _quota_of(self, tenant: str) -> Quota | None:
        now = self._clock()
        cached = self._config.get(tenant)
        if cached is not None and cached[0] > now:
            return cached[1]
        own, default = await self._redis.hmget(self._keys.quotas, [tenant, "*"])
        quota: Quota | None = None
        raw = own if own is not None else default
        if raw is not None:
            try:
                quota = Quota.parse(tenant, raw)
            except (ValueError, TypeError) as exc:
                log.error("ignoring malformed quota of tenant %s: %s", tenant, exc)
        if quota is not None and not quota.active:
            quota = None
        if len(self._config) > 50_000:
            self._config.clear()
        self._config[tenant] = (now + self._ttl, quota)
        return quota

    async def check(self, tenant: str) -> None:
        """Count one request of `tenant`, or refuse it.

        Raises:
            ResourceExhausted: reason ``tenant-quota``; the message names the quota
                and when it resets (UTC), ``retry_after_s`` is the time until then.
            Unavailable: Redis is unreachable and the mode is ``fail-closed``.
        """
        if self.degraded and self._clock() < self._retry_at:
            # Redis failed moments ago: do not make every request wait for it again.
            self._redis_down()
            return
        try:
            quota = await self._quota_of(tenant)
            if quota is None:
                self._set_degraded(False)
                return
            now = self._wall_clock()
            p = Periods.at(now)
            verdict, _day_count, _month_count = await self._script(
                keys=[
                    self._keys.quota_count(tenant, "d", p.day),
                    self._keys.quota_count(tenant, "m", p.month),
                ],
                args=[
                    quota.per_day,
                    quota.per_month,
                    int(p.day_end.timestamp()) + _EXPIRY_GRACE_S,
                    int(p.month_end.timestamp()) + _EXPIRY_GRACE_S,
                ],
            )
        except REDIS_DOWN_ERRORS as exc:
            reraise_if_cancelling()
            self._set_degraded(True, exc)
            self._retry_at = self._clock() + self._retry_interval_s
            self._redis_down()
            return
        self._set_degraded(False)
        if verdict == 0:
            return
        if verdict == 1:
            period, limit, resets = "daily", quota.per_day, p.day_end
        else:
            period, limit, resets = "monthly", quota.per_month, p.month_end
        QUOTA_REJECTED.labels(period).inc()
        raise ResourceExhausted(
            f"tenant '{tenant}' has used its {period} quota of {limit} requests; "
            f"it resets at {_iso(resets)} (strategy: tenant-quota)",
            reason="tenant-quota",
            retry_after_s=max(1.0, (resets - now).total_seconds()),
        )
