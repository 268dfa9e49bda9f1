"""Cluster-wide QPS limits, spent locally from small leases of Redis token buckets.

`RateLimiter` takes a few tokens at a time from each shared bucket with one Lua
script (Redis ``TIME``, never the gateways' clocks), spends them in-process,
refills ahead in the background, and falls back to a per-gateway share
(fail-open) or UNAVAILABLE (fail-closed) while Redis is down. The limits'
schema is `inferbus_common.admission.limits`. See docs/architecture.md
("Cluster QPS limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Literal, Self

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge

from inferbus_common.admission.keys import (
    REDIS_DOWN_ERRORS,
    AdmissionKeys,
    reraise_if_cancelling,
)
from inferbus_common.admission.limits import Limit, parse_limits
from inferbus_common.errors import ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

REJECTED = Counter(
    "inferbus_gateway_ratelimit_rejected_total",
    "Requests rejected by a QPS limit, by reason.",
    ["reason"],
)
DEGRADED = Gauge(
    "inferbus_gateway_ratelimit_degraded",
    "1 while Redis is unreachable and the limiter runs in its failure mode, else 0.",
    ["mode"],
)
REDIS_CALLS = Counter(
    "inferbus_gateway_ratelimit_redis_calls_total",
    "Lease requests sent to Redis (one per lease, not per request).",
)

REQUEST_WAITS = Counter(
    "inferbus_gateway_ratelimit_request_waits_total",
    "Requests that had to wait for a lease from Redis (the rest spend leased tokens).",
)
ADMITTED = Counter(
    "inferbus_gateway_ratelimit_admitted_total",
    "Requests a QPS limit applied to and let through, by how: cluster (tokens leased "
    "from Redis), degraded (this gateway's share while Redis is down), instance (only "
    "the per-instance limit applied). Refusals: inferbus_gateway_ratelimit_rejected_total.",
    ["mode"],
)
_ADMITTED_CLUSTER = ADMITTED.labels("cluster")
_ADMITTED_DEGRADED = ADMITTED.labels("degraded")
_ADMITTED_INSTANCE = ADMITTED.labels("instance")

FailureMode = Literal["fail-open", "fail-closed"]

#: Longest a lease may live: beyond this, leased tokens sitting in one gateway
#: distort the cluster-wide rate.
MAX_LEASE_TTL_S = 0.2


INSTANCE_REASON = "instance-qps"


# --- in-process bucket -----------------------------------------------------------


class TokenBucket:
    """An in-process token bucket on the monotonic clock.

    Args:
        rate: tokens added per second.
        burst: capacity (the bucket starts full).
        clock: monotonic clock in seconds (injectable for tests).
    """

    __slots__ = ("_clock", "_last", "burst", "rate", "tokens")

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self.tokens = self.burst
        self._clock = clock
        self._last = self._clock()

    def _refill(self, now: float) -> None:
        if now > self._last:
            self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
            self._last = now

    def try_take(self, now: float | None = None) -> bool:
        """Take one token if there is one."""
        self._refill(self._clock() if now is None else now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def give_back(self) -> None:
        """Return a token taken for a request that another limit then rejected."""
        self.tokens = min(self.burst, self.tokens + 1.0)

    def wait_s(self) -> float:
        """Seconds until one token is available."""
        return max(0.0, (1.0 - self.tokens) / self.rate)


# --- the cluster limiter -------------------------------------------------------------

# KEYS: bucket keys. ARGV: per key, (qps, capacity, want).
# Returns per key: granted tokens, µs until `want` tokens will be there again.
_LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out = {}
for i, key in ipairs(KEYS) do
  local rate = tonumber(ARGV[3 * i - 2])
  local cap = tonumber(ARGV[3 * i - 1])
  local want = tonumber(ARGV[3 * i])
  local st = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(st[1])
  local ts = tonumber(st[2])
  if tokens == nil or ts == nil then
    tokens = cap
    ts = now
  end
  if now > ts then
    tokens = math.min(cap, tokens + (now - ts) * rate / 1000000)
    ts = now
  end
  local grant = math.min(want, math.floor(tokens))
  if grant < 0 then grant = 0 end
  tokens = tokens - grant
  local wait = 0
  if grant < want then
    wait = math.ceil((math.min(want, cap) - tokens) * 1000000 / rate)
  end
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(ts))
  redis.call('PEXPIRE', key, math.ceil(cap * 1000 / rate) + 1000)
  out[2 * i - 1] = grant
  out[2 * i] = wait
end
return out
"""

# KEYS[1]: gateways zset. ARGV: instance id, ttl ms. Returns live gateways.
_HEARTBEAT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])
"""


@dataclasses.dataclass(slots=True, eq=False)
class _Lease:
    """This gateway's share of one bucket (one limit × tenant × model)."""

    limit: Limit
    key: str
    message: str
    tokens: int = 0
    expires: float = 0.0
    blocked_until: float = 0.0
    fallback: TokenBucket | None = None
    refilling: bool = False
    """A refill-ahead task for this lease is running."""

    def usable(self, now: float) -> bool:
        return self.tokens > 0 and now < self.expires

    def running_low(self) -> bool:
        """Half the lease is spent: time to ask for the next one in the background."""
        return self.tokens <= self.limit.lease_size // 2


class RateLimiter:
    """Cluster-wide QPS limits (Redis, leased) plus an optional per-instance limit.

    Use as an async context manager: entering loads the limits, registers this
    gateway and starts the heartbeat that reloads limits and watches Redis.

    Args:
        redis: this gateway's client (see `connect_redis`).
        keys: Redis key names.
        instance_id: this gateway's unique name (registered for the live count).
        failure_mode: ``fail-open`` or ``fail-closed`` while Redis is unreachable.
        instance_qps: per-instance limit (reason ``instance-qps``); 0 disables it.
        instance_burst: capacity of the per-instance bucket (0 = 5 % of QPS, ≥ 1).
        lease_ttl_s: how long leased tokens stay usable (≤ 0.2 s).
        reload_interval_s: heartbeat period: limits reload, gateway count, Redis
            recovery (≤ 1 s).
        gateway_ttl_s: a gateway not heard from for this long is not counted.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: AdmissionKeys,
        *,
        instance_id: str,
        failure_mode: FailureMode = "fail-open",
        instance_qps: float = 0.0,
        instance_burst: float = 0.0,
        lease_ttl_s: float = MAX_LEASE_TTL_S,
        reload_interval_s: float = 0.5,
        gateway_ttl_s: float = 3.0,
    ) -> None:
        if not 0 < lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ValueError(f"lease_ttl_s must be in (0, {MAX_LEASE_TTL_S}]")
        if not 0 < reload_interval_s <= 1.0:
            raise ValueError("reload_interval_s must be in (0, 1]")
        self._redis = redis
        self._keys = keys
        self.instance_id = instance_id
        self.failure_mode: FailureMode = failure_mode
        DEGRADED.labels(failure_mode).set(0)  # exported (0) before any outage, for alerts
        self._lease_ttl_s = lease_ttl_s
        self._reload_interval_s = reload_interval_s
        self._gateway_ttl_ms = int(gateway_ttl_s * 1000)
        self._instance: TokenBucket | None = None
        self._instance_message = ""
        if instance_qps > 0:
            burst = instance_burst or max(1.0, instance_qps * 0.05)
            self._instance = TokenBucket(instance_qps, burst)
            self._instance_message = (
                f"this gateway instance is limited to {instance_qps:g} requests/s "
                f"(strategy: {INSTANCE_REASON})"
            )
        self._lease_script = redis.register_script(_LEASE_SCRIPT)
        self._heartbeat_script = redis.register_script(_HEARTBEAT_SCRIPT)
        self._limits: dict[str, Limit] = {}
        self._leases: dict[tuple[str, str, str], tuple[_Lease, ...]] = {}
        self._by_key: dict[str, _Lease] = {}
        self._lock = asyncio.Lock()
        self._degraded = False
        self._config_lost_logged = False
        self.live_gateways = 1
        """Gateways registered in Redis at the last heartbeat (kept while Redis is down)."""
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._refills: set[asyncio.Task[None]] = set()

    # --- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.sync()
        self._task = asyncio.create_task(self._heartbeat_loop(), name="ratelimit-heartbeat")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the heartbeat and deregister this gateway (idempotent)."""
        task, self._task = self._task, None
        self._closing.set()
        if task is not None:
            # The loop sees the event and ends after at most one heartbeat (bounded by
            # the Redis timeout); no cancel, which redis-py could mistake for a timeout.
            await task
        if self._refills:
            await asyncio.gather(*self._refills)
        if not self._degraded:
            try:
                await self._redis.zrem(self._keys.gateways, self.instance_id)
            except REDIS_DOWN_ERRORS:
                reraise_if_cancelling()  # else: its heartbeat simply expires

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable and the failure mode applies."""
        return self._degraded

    @property
    def limits(self) -> dict[str, Limit]:
        """The limits in force (by hash field), as last loaded."""
        return dict(self._limits)

    # --- heartbeat ---------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._reload_interval_s):
                    await self._closing.wait()
            if self._closing.is_set():
                return
            try:
                await self.sync()
            except Exception:
                # A bug here must not stop limit reloads for the life of the process.
                log.exception("rate limiter heartbeat failed")

    async def sync(self) -> None:
        """Register this gateway, count live gateways and reload limits (one heartbeat).

        Never raises for Redis failures: they switch the limiter to its failure mode.
        """
        try:
            count = await self._heartbeat_script(
                keys=[self._keys.gateways], args=[self.instance_id, self._gateway_ttl_ms]
            )
            raw = await self._redis.hgetall(self._keys.limits)
        except REDIS_DOWN_ERRORS as exc:
            reraise_if_cancelling()
            self._set_degraded(True, exc)
            return
        self.live_gateways = max(1, int(count))
        if raw:
            self._config_lost_logged = False
            self._apply_limits(parse_limits(raw))
        elif self._limits and not self._config_lost_logged:
            self._config_lost_logged = True
            log.warning(
                "rate limits hash %s is gone (Redis restarted without persistence?); "
                "keeping the %d limits last seen until it is written again",
                self._keys.limits,
                len(self._limits),
            )
        self._set_degraded(False, None)

    def _apply_limits(self, limits: dict[str, Limit]) -> None:
        if limits == self._limits:
            return
        log.info("rate limits loaded: %s", ", ".join(sorted(limits)) or "none")
        self._limits = limits
        self._leases.clear()
        self._by_key.clear()

    def _set_degraded(self, degraded: bool, exc: BaseException | None) -> None:
        if degraded == self._degraded:
            return
        self._degraded = degraded
        DEGRADED.labels(self.failure_mode).set(1 if degraded else 0)
        # Fresh leases and fallback buckets for the new state.
        self._leases.clear()
        self._by_key.clear()
        if degraded:
            if self.failure_mode == "fail-open":
                log.warning(
                    "rate limiter cannot reach Redis (%s); fail-open: enforcing cluster "
                    "limits / %d live gateways in this process",
                    type(exc).__name__,
                    self.live_gateways,
                )
            else:
                log.error(
                    "rate limiter cannot reach Redis (%s); fail-closed: rejecting limited "
                    "requests with UNAVAILABLE",
                    type(exc).__name__,
                )
        else:
            log.info("rate limiter reached Redis again; cluster-wide limits restored")

    # --- the request path ------------------------------------------------------------
    def _resolve(self, interface: str, model: str, tenant: str) -> tuple[_Lease, ...]:
        """The leases that apply to a request (cached per (interface, model, tenant))."""
        ck = (interface, model, tenant)
        found = self._leases.get(ck)
        if found is not None:
            return found
        limits = self._limits
        chosen: list[tuple[Limit, str]] = []
        lim = limits.get(f"interface:{interface}")
        if lim is not None:
            chosen.append((lim, f"interface:{interface}"))
        lim = limits.get(f"model:{model}")
        if lim is not None:
            chosen.append((lim, f"model:{model}"))
        for t, m in ((tenant, model), (tenant, "*"), ("*", model), ("*", "*")):
            lim = limits.get(f"tenant-model:{t}:{m}")
            if lim is not None:
                chosen.append((lim, f"tenant-model:{tenant}:{model}"))
                break
        leases: list[_Lease] = []
        for lim, bucket_field in chosen:
            key = self._keys.bucket(bucket_field)
            lease = self._by_key.get(key)
            if lease is None:
                lease = _Lease(lim, key, lim.describe(tenant, model, interface))
                self._by_key[key] = lease
            leases.append(lease)
        found = tuple(leases)
        if len(self._leases) > 50_000:  # many tenants × models: bound the cache
            self._leases.clear()
        self._leases[ck] = found
        return found

    def _reject(self, reason: str, message: str, retry_after_s: float) -> ResourceExhausted:
        REJECTED.labels(reason).inc()
        return ResourceExhausted(message, reason=reason, retry_after_s=max(0.001, retry_after_s))

    async def acquire(self, *, interface: str, model: str, tenant: str = "") -> None:
        """Admit one request or raise.

        Args:
            interface: the API called, e.g. ``ModelInfer``.
            model: the model named in the request.
            tenant: the caller's tenant (empty when unauthenticated).

        Raises:
            ResourceExhausted: a limit is reached; ``reason`` is ``cluster-qps``,
                ``model-qps``, ``tenant-quota`` or ``instance-qps`` and the message
                names the limit.
            Unavailable: Redis is unreachable and the mode is ``fail-closed``.
        """
        now = time.monotonic()
        instance = self._instance
        if instance is not None and not instance.try_take(now):
            raise self._reject(INSTANCE_REASON, self._instance_message, instance.wait_s())
        try:
            leases = self._resolve(interface, model, tenant)
            if leases:
                if self._degraded:
                    self._acquire_degraded(leases, now)
                    _ADMITTED_DEGRADED.inc()
                else:
                    await self._acquire_cluster(leases, now)
                    _ADMITTED_CLUSTER.inc()
            elif instance is not None:
                _ADMITTED_INSTANCE.inc()
        except BaseException:
            if instance is not None:
                instance.give_back()
            raise

    async def _acquire_cluster(self, leases: tuple[_Lease, ...], now: float) -> None:
        # Other requests may spend a lease while this one waits for Redis, so the
        # check is repeated after each refill (a few rounds at most).
        for _ in range(3):
            need = [le for le in leases if not le.usable(now)]
            if not need:
                low: list[_Lease] = []
                for le in leases:
                    le.tokens -= 1
                    if le.running_low() and not le.refilling and now >= le.blocked_until:
                        low.append(le)
                if low:
                    self._refill_ahead(low)
                return
            for le in need:
                if now < le.blocked_until:
                    raise self._reject(le.limit.scope.reason, le.message, le.blocked_until - now)
            async with self._lock:
                now = time.monotonic()
                need = [le for le in leases if not le.usable(now)]
                if need and not self._degraded:
                    REQUEST_WAITS.inc()
                    try:
                        await self._lease(need, now)
                    except REDIS_DOWN_ERRORS as exc:
                        reraise_if_cancelling()
                        self._set_degraded(True, exc)
            if self._degraded:
                self._acquire_degraded(leases, time.monotonic())
                return
            now = time.monotonic()
        le = next(le for le in leases if not le.usable(now))
        raise self._reject(le.limit.scope.reason, le.message, max(le.blocked_until - now, 0.001))

    def _refill_ahead(self, leases: list[_Lease]) -> None:
        """Fetch the next leases in the background (one Redis call for all of them)."""
        for le in leases:
            le.refilling = True
        task = asyncio.create_task(self._run_refill_ahead(leases), name="ratelimit-refill")
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _run_refill_ahead(self, leases: list[_Lease]) -> None:
        try:
            async with self._lock:
                # A request may have refilled them meanwhile, or the state changed.
                low = [le for le in leases if le.running_low()]
                if low and not self._degraded and not self._closing.is_set():
                    await self._lease(low, time.monotonic(), add=True)
        except REDIS_DOWN_ERRORS as exc:
            reraise_if_cancelling()
            self._set_degraded(True, exc)
        except Exception:
            log.exception("rate limiter refill failed")
        finally:
            for le in leases:
                le.refilling = False

    async def _lease(self, need: list[_Lease], now: float, *, add: bool = False) -> None:
        """Take tokens for `need` from Redis; `add` keeps unexpired tokens (refill-ahead)."""
        args: list[float | int] = []
        for le in need:
            args += [le.limit.qps, le.limit.capacity, le.limit.lease_size]
        REDIS_CALLS.inc()
        out = await self._lease_script(keys=[le.key for le in need], args=args)
        now = time.monotonic()
        for i, le in enumerate(need):
            granted, wait_us = int(out[2 * i]), int(out[2 * i + 1])
            le.tokens = le.tokens + granted if add and le.usable(now) else granted
            le.expires = now + self._lease_ttl_s
            le.blocked_until = now + wait_us / 1e6

    def _acquire_degraded(self, leases: tuple[_Lease, ...], now: float) -> None:
        if self.failure_mode == "fail-closed":
            REJECTED.labels("redis-unavailable").inc()
            raise Unavailable(
                "the cluster rate limiter cannot reach Redis and is configured to fail "
                "closed; retry shortly"
            )
        n = max(1, self.live_gateways)
        taken: list[TokenBucket] = []
        for le in leases:
            if le.fallback is None:
                le.fallback = TokenBucket(le.limit.qps / n, max(1.0, le.limit.capacity / n))
            if not le.fallback.try_take(now):
                for b in taken:
                    b.give_back()
                raise self._reject(
                    le.limit.scope.reason,
                    f"{le.message}; Redis is unreachable, so this gateway enforces 1/{n} of it",
                    le.fallback.wait_s(),
                )
            taken.append(le.fallback)
