"""Tokens-per-minute limits per tenant for generative requests: one Redis token
bucket per tenant, charged an estimate up front and settled with the worker's
real token counts when the request ends. See docs/architecture.md ("Tokens per
minute").

Which tenants have a limit is read from Redis every ``reload_interval_s`` (as
the QPS limits are), so a request of a tenant without one costs no Redis call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from typing import Self

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge

from inferbus_common.admission.keys import REDIS_DOWN_ERRORS, reraise_if_cancelling
from inferbus_common.errors import ResourceExhausted

log = logging.getLogger(__name__)

REASON = "tenant-tpm"
CHARS_PER_TOKEN = 4

TPM_REJECTED = Counter(
    "inferbus_gateway_tpm_rejected_total",
    "Generative requests refused by a tenant's tokens-per-minute limit.",
)
TPM_TOKENS = Counter(
    "inferbus_gateway_tpm_tokens_total",
    "Tokens charged to tenants' TPM buckets, by phase (estimate, settle).",
    ["phase"],
)
TPM_LIMITS = Gauge(
    "inferbus_gateway_tpm_limits",
    "Tokens-per-minute limits this gateway last loaded from Redis (entries of the "
    "limits hash, '*' included); -1 until the first load.",
)
TPM_LIMITS.set(-1)

# KEYS[1] bucket, KEYS[2] limits hash. ARGV: tenant, cost, require (1/0).
# Returns {allowed 0/1, limit tpm (-1: none), µs until `cost` is available}.
_CHARGE_SCRIPT = """
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then raw = redis.call('HGET', KEYS[2], '*') end
if not raw then return {1, -1, 0} end
local tpm, burst
local ok, doc = pcall(cjson.decode, raw)
if ok and type(doc) == 'table' then
  tpm = tonumber(doc['tpm'])
  burst = tonumber(doc['burst'])
else
  tpm = tonumber(raw)
end
if not tpm or tpm <= 0 then return {1, -1, 0} end
if not burst or burst <= 0 then burst = tpm end
local rate = tpm / 60000000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local st = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(st[1])
local ts = tonumber(st[2])
if tokens == nil or ts == nil then tokens = burst; ts = now end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
  ts = now
end
local cost = tonumber(ARGV[2])
if ARGV[3] == '1' and tokens < cost then
  local wait = math.ceil((math.min(cost, burst) - tokens) / rate)
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
  return {0, tpm, wait}
end
tokens = math.min(burst, tokens - cost)
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
redis.call('PEXPIRE', KEYS[1], 120000 + math.ceil(math.max(0, -tokens) / rate / 1000))
return {1, tpm, 0}
"""


def estimate_prompt_tokens(texts: list[str]) -> int:
    """Up-front estimate of a prompt's tokens: ~4 characters per token, at least 1."""
    chars = sum(len(t) for t in texts)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


async def set_tpm_limit(
    redis: aioredis.Redis, prefix: str, tenant: str, tpm: int, burst: int | None = None
) -> None:
    """Set (or replace) a tenant's TPM limit (``*``: every tenant without its own)."""
    value = {"tpm": tpm} if burst is None else {"tpm": tpm, "burst": burst}
    await redis.hset(f"{prefix}:tpm", tenant, json.dumps(value))


class TokenLimiter:
    """Charges generative requests' tokens to their tenant's TPM bucket.

    Used as an async context manager, it reloads which tenants have a limit every
    `reload_interval_s` and charges only those (a limit written to Redis applies
    within that interval); outside one, or until the first load succeeds, every
    request runs the charge script, which finds out itself.

    Args:
        redis: the admission Redis client.
        prefix: key prefix (``AdmissionKeys.prefix``).
        reload_interval_s: how often the limits hash is read again.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str, reload_interval_s: float = 0.5) -> None:
        self._redis = redis
        self.limits_key = f"{prefix}:tpm"
        self._prefix = prefix
        self._script = redis.register_script(_CHARGE_SCRIPT)
        self._down = False
        self._reload_interval_s = reload_interval_s
        self._limited: frozenset[str] | None = None
        """Fields of the limits hash last loaded (tenants, ``*``); None: not loaded."""
        self._reloader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await self._try_reload()
        self._reloader = asyncio.create_task(self._reload_loop(), name="tpm-limits")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._reloader is not None:
            self._reloader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reloader
            self._reloader = None

    async def reload(self) -> None:
        """Read which tenants have a limit; on a Redis error keep what was loaded."""
        try:
            fields = await self._redis.hkeys(self.limits_key)
        except REDIS_DOWN_ERRORS:
            reraise_if_cancelling()
            return  # `_charge` logs Redis being down once, from the requests
        self._limited = frozenset(f.decode() if isinstance(f, bytes) else f for f in fields)
        TPM_LIMITS.set(len(self._limited))

    async def _try_reload(self) -> None:
        try:
            await self.reload()
        except Exception as exc:  # e.g. the key holds another type: keep what we have
            log.warning("could not read the TPM limits in %s: %s", self.limits_key, exc)

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(self._reload_interval_s)
            await self._try_reload()

    def limited(self, tenant: str) -> bool:
        """Whether `tenant`'s requests are charged: it (or ``*``) has a limit, or the
        limits are not known."""
        limited = self._limited
        return limited is None or tenant in limited or "*" in limited

    def bucket_key(self, tenant: str) -> str:
        """Redis key of a tenant's bucket (one hash tag, so Cluster keeps them together)."""
        return f"{{{self._prefix}:tpm}}:{tenant}"

    async def _charge(self, tenant: str, cost: int, require: bool) -> tuple[bool, float]:
        try:
            allowed, _limit, wait_us = await self._script(
                keys=[self.bucket_key(tenant), self.limits_key],
                args=[tenant, cost, "1" if require else "0"],
            )
        except REDIS_DOWN_ERRORS as exc:
            reraise_if_cancelling()
            if not self._down:
                self._down = True
                log.warning("TPM limits not enforced: Redis unreachable (%s)", exc)
            return True, 0.0
        if self._down:
            self._down = False
            log.info("TPM limits enforced again: Redis answers")
        return bool(allowed), int(wait_us) / 1e6

    async def reserve(self, tenant: str, estimate: int) -> bool:
        """Charge the up-front estimate; refuse when the tenant's bucket cannot pay it.

        Returns:
            Whether it was charged (False: the tenant has no limit; settle nothing).

        Raises:
            ResourceExhausted: reason ``tenant-tpm``, with the wait until it can.
        """
        if not self.limited(tenant):
            return False
        allowed, wait_s = await self._charge(tenant, estimate, True)
        if not allowed:
            TPM_REJECTED.inc()
            raise ResourceExhausted(
                f"tenant '{tenant}' is over its tokens-per-minute limit; retry in "
                f"{max(wait_s, 0.001):.1f}s or ask for a higher limit",
                reason=REASON,
                retry_after_s=max(wait_s, 0.001),
            )
        TPM_TOKENS.labels("estimate").inc(estimate)
        return True

    async def settle(self, tenant: str, estimate: int, actual: int) -> None:
        """Charge ``actual - estimate`` (a refund when negative); never refuses."""
        delta = actual - estimate
        if delta:
            await self._charge(tenant, delta, False)
        TPM_TOKENS.labels("settle").inc(max(0, delta))
