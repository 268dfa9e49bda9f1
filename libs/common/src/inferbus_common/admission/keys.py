"""Redis key names of the admission data and the client that reaches them.

Admission control sits on the request path, so its Redis client must fail
fast: a short socket timeout and no client-side retries (redis-py retries
with a back-off of a second by default, which would stall every request while
Redis is down). Callers turn a failure into fail-open or fail-closed.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

#: Errors that mean "Redis cannot answer right now" (as opposed to a bug).
REDIS_DOWN_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError)


def reraise_if_cancelling() -> None:
    """Re-raise a cancellation that a Redis error has hidden.

    redis-py wraps reads in ``asyncio.timeout``; when the task is cancelled just as
    the socket timeout fires, the caller sees a timeout error instead of the
    `CancelledError`. Call this in every ``except REDIS_DOWN_ERRORS`` handler so a
    cancelled request or background loop really stops.

    Raises:
        asyncio.CancelledError: when the current task is being cancelled.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def connect_redis(
    url: str, *, timeout_s: float = 0.25, password: str | None = None
) -> aioredis.Redis:
    """Build an asyncio Redis client tuned for the request path.

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS).
        timeout_s: connect and socket timeout; a stalled Redis costs a request at
            most this long before the caller falls back.
        password: AUTH password when the URL carries none.

    Returns:
        A client (connections are opened lazily, on first use).
    """
    return aioredis.Redis.from_url(
        url,
        password=password or None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        decode_responses=False,
    )


class AdmissionKeys:
    """Names of every Redis key the admission modules use, from one prefix.

    Args:
        prefix: first part of every key (``ib`` by default), so that several
            inferbus installations can share one Redis.
    """

    def __init__(self, prefix: str = "ib") -> None:
        self.prefix = prefix
        self.auth_keys = f"{prefix}:auth:keys"
        """Hash: SHA-256 of an API key → JSON ``{tenant, key_id, created, revoked}``."""
        self.auth_key_ids = f"{prefix}:auth:key-ids"
        """Hash: key id → SHA-256 of the key (to revoke or list by id)."""
        self.limits = f"{prefix}:limits"
        """Hash: limit field (``model:fraud``) → JSON ``{qps, burst}``; ``_rev`` counts edits."""
        self.gateways = f"{prefix}:gateways"
        """Sorted set: gateway instance id → last heartbeat (Redis time, ms)."""
        self.quotas = f"{prefix}:quotas"
        """Hash: tenant (or ``*``) → JSON ``{per_day, per_month}``."""

    def auth_models(self, tenant: str) -> str:
        """Set of the model names `tenant` may call (``*`` = every model)."""
        return f"{self.prefix}:auth:models:{tenant}"

    def bucket(self, field: str) -> str:
        """Token bucket of one limit.

        All buckets share the hash tag ``{<prefix>:rl}`` so that one Lua script may
        touch several of them atomically on a Redis Cluster too.
        """
        return f"{{{self.prefix}:rl}}:{field}"

    def quota_count(self, tenant: str, period: str, stamp: str) -> str:
        """Counter of `tenant`'s requests in one period (``d`` day or ``m`` month)."""
        return f"{{{self.prefix}:quota:{tenant}}}:{period}:{stamp}"
