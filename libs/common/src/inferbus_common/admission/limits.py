"""Cluster-wide QPS limits as stored in Redis (hash ``<prefix>:limits``): their
schema and the edits `inferbus limits` makes; the gateway's `RateLimiter` reads
them. See docs/architecture.md ("Admission at the gateway") and
docs/operations.md.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
from collections.abc import Mapping

import redis.asyncio as aioredis

from inferbus_common.admission.keys import AdmissionKeys

log = logging.getLogger(__name__)

REV_FIELD = "_rev"
"""Hash field bumped by every edit, so an emptied config differs from a lost one."""


class Scope(enum.Enum):
    """What a limit counts, with its hash-field prefix and rejection reason."""

    INTERFACE = ("interface", "cluster-qps")
    MODEL = ("model", "model-qps")
    TENANT_MODEL = ("tenant-model", "tenant-quota")

    def __init__(self, field_prefix: str, reason: str) -> None:
        self.field_prefix = field_prefix
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class Limit:
    """One configured QPS limit.

    Attributes:
        scope: what it counts.
        name: interface name, model name, or ``tenant:model`` (``*`` allowed in
            a tenant-model name).
        qps: tokens added per second.
        burst: bucket capacity; None = the default ``max(2 leases, 10 % of qps)``.
    """

    scope: Scope
    name: str
    qps: float
    burst: float | None = None

    @property
    def field(self) -> str:
        """The hash field this limit is stored under."""
        return f"{self.scope.field_prefix}:{self.name}"

    @property
    def lease_size(self) -> int:
        """Tokens a gateway takes from Redis at once: ``min(5 % of qps, 10)``, at least 1."""
        return max(1, min(10, math.floor(self.qps * 0.05)))

    @property
    def capacity(self) -> float:
        """The bucket's capacity (explicit burst, else the default)."""
        if self.burst is not None:
            return self.burst
        return max(2.0 * self.lease_size, self.qps * 0.1)

    def to_json(self) -> str:
        """The hash value stored for this limit."""
        body: dict[str, float] = {"qps": self.qps}
        if self.burst is not None:
            body["burst"] = self.burst
        return json.dumps(body)

    @classmethod
    def parse(cls, field: str, value: str) -> Limit:
        """Build a limit from its hash field and value.

        Raises:
            ValueError: unknown scope, malformed name or value.
        """
        prefix, sep, name = field.partition(":")
        if not sep or not name:
            raise ValueError(f"limit field {field!r} is not '<scope>:<name>'")
        try:
            scope = next(s for s in Scope if s.field_prefix == prefix)
        except StopIteration:
            raise ValueError(
                f"limit field {field!r}: unknown scope {prefix!r}; "
                f"expected one of {[s.field_prefix for s in Scope]}"
            ) from None
        if scope is Scope.TENANT_MODEL and ":" not in name:
            raise ValueError(f"limit field {field!r}: expected 'tenant-model:<tenant>:<model>'")
        raw = json.loads(value)
        if isinstance(raw, int | float):
            qps, burst = float(raw), None
        elif isinstance(raw, dict):
            qps = float(raw["qps"])
            burst = None if raw.get("burst") is None else float(raw["burst"])
        else:
            raise ValueError(f"limit {field!r}: value must be a number or {{qps, burst}}")
        if qps <= 0 or (burst is not None and burst < 1):
            raise ValueError(f"limit {field!r}: qps must be > 0 and burst >= 1")
        return cls(scope, name, qps, burst)

    def describe(self, tenant: str, model: str, interface: str) -> str:
        """Client-facing text naming this limit."""
        rate = f"{self.qps:g} requests/s"
        if self.scope is Scope.INTERFACE:
            return (
                f"interface '{interface}' is limited to {rate} across the cluster "
                f"(strategy: {self.scope.reason})"
            )
        if self.scope is Scope.MODEL:
            return f"model '{model}' is limited to {rate} (strategy: {self.scope.reason})"
        return (
            f"tenant '{tenant}' is limited to {rate} on model '{model}' "
            f"(strategy: {self.scope.reason})"
        )


async def set_limit(redis: aioredis.Redis, keys: AdmissionKeys, limit: Limit) -> None:
    """Create or change a limit; gateways apply it within their reload interval."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.limits, limit.field, limit.to_json())
        pipe.hincrby(keys.limits, REV_FIELD, 1)
        await pipe.execute()


async def delete_limit(redis: aioredis.Redis, keys: AdmissionKeys, scope: Scope, name: str) -> bool:
    """Remove a limit; True when it existed."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hdel(keys.limits, f"{scope.field_prefix}:{name}")
        pipe.hincrby(keys.limits, REV_FIELD, 1)
        removed, _ = await pipe.execute()
    return bool(removed)


def parse_limits(raw: Mapping[bytes | str, bytes | str]) -> dict[str, Limit]:
    """Parse a whole limits hash, skipping (and logging) malformed entries."""
    limits: dict[str, Limit] = {}
    for k, v in raw.items():
        field = k.decode() if isinstance(k, bytes) else k
        if field == REV_FIELD:
            continue
        value = v.decode() if isinstance(v, bytes) else v
        try:
            limit = Limit.parse(field, value)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring malformed rate limit %r: %s", field, exc)
            continue
        limits[limit.field] = limit
    return limits


async def list_limits(redis: aioredis.Redis, keys: AdmissionKeys) -> list[Limit]:
    """Every configured limit, sorted by field (for `inferbus limits`)."""
    limits = parse_limits(await redis.hgetall(keys.limits))
    return [limits[f] for f in sorted(limits)]
