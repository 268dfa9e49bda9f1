"""API keys and tenants' model access lists as stored in Redis: only a key's SHA-256
is kept. `KeyStore` is the back end of `inferbus keys` and the gateway's lookups.
See docs/security.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import secrets

import redis.asyncio as aioredis

from inferbus_common.admission.keys import AdmissionKeys

log = logging.getLogger(__name__)

API_KEY_PREFIX = "ib_"
"""Every API key starts with this, which tells it apart from a JWT."""
ALL_MODELS = "*"
"""On an access list: every model."""


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """What Redis holds about one API key (never the key itself)."""

    tenant: str
    key_id: str
    created: str
    """UTC ISO-8601 time of creation."""
    revoked: str | None = None
    """UTC ISO-8601 time of revocation, None while valid."""

    def to_json(self) -> str:
        """The hash value stored in Redis."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ApiKeyRecord:
        """Parse a stored record."""
        data = json.loads(raw)
        revoked = data.get("revoked")
        # Older writers may store a bool; any truthy value means revoked.
        if revoked is True:
            revoked = "unknown"
        elif not revoked:
            revoked = None
        return cls(data["tenant"], data["key_id"], data.get("created", ""), revoked)


def hash_api_key(secret: str) -> str:
    """Hex SHA-256 of an API key: the only form in which keys are stored."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _utc_now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class KeyStore:
    """API keys and access lists in Redis (also the back end of `inferbus keys`).

    Args:
        redis: client.
        keys: Redis key names.
    """

    def __init__(self, redis: aioredis.Redis, keys: AdmissionKeys) -> None:
        self._redis = redis
        self._keys = keys

    async def create_key(self, tenant: str, *, key_id: str = "") -> tuple[ApiKeyRecord, str]:
        """Create an API key for `tenant`.

        Args:
            tenant: owner of the key.
            key_id: a name for the key (unique); generated when empty.

        Returns:
            The stored record and the secret key, which is not kept anywhere:
            show it to the operator once.

        Raises:
            ValueError: the tenant is empty or the key id is taken.
        """
        if not tenant or ":" in tenant:
            raise ValueError("tenant must be non-empty and contain no ':'")
        key_id = key_id or f"k_{secrets.token_hex(6)}"
        secret = API_KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_api_key(secret)
        record = ApiKeyRecord(tenant=tenant, key_id=key_id, created=_utc_now_iso())
        if not await self._redis.hsetnx(self._keys.auth_key_ids, key_id, digest):
            raise ValueError(f"API key id {key_id!r} already exists")
        await self._redis.hset(self._keys.auth_keys, digest, record.to_json())
        log.info("API key %s created for tenant %s", key_id, tenant, extra={"tenant": tenant})
        return record, secret

    async def revoke_key(self, key_id: str) -> bool:
        """Revoke a key by id; True when it existed and was valid until now."""
        digest = await self._redis.hget(self._keys.auth_key_ids, key_id)
        if digest is None:
            return False
        raw = await self._redis.hget(self._keys.auth_keys, digest)
        if raw is None:
            return False
        record = ApiKeyRecord.from_json(raw)
        if record.revoked:
            return False
        record = dataclasses.replace(record, revoked=_utc_now_iso())
        await self._redis.hset(self._keys.auth_keys, digest, record.to_json())
        log.info("API key %s of tenant %s revoked", key_id, record.tenant)
        return True

    async def list_keys(self, tenant: str = "") -> list[ApiKeyRecord]:
        """Every key's record (of one tenant when given), sorted by tenant and id."""
        records = [
            ApiKeyRecord.from_json(v)
            for v in (await self._redis.hgetall(self._keys.auth_keys)).values()
        ]
        if tenant:
            records = [r for r in records if r.tenant == tenant]
        return sorted(records, key=lambda r: (r.tenant, r.key_id))

    async def lookup(self, secret: str) -> ApiKeyRecord | None:
        """The record of an API key, None when unknown."""
        raw = await self._redis.hget(self._keys.auth_keys, hash_api_key(secret))
        return None if raw is None else ApiKeyRecord.from_json(raw)

    async def allow_models(self, tenant: str, *models: str) -> None:
        """Let `tenant` call `models` (``*`` = every model)."""
        if models:
            await self._redis.sadd(self._keys.auth_models(tenant), *models)

    async def disallow_models(self, tenant: str, *models: str) -> None:
        """Take models off `tenant`'s access list."""
        if models:
            await self._redis.srem(self._keys.auth_models(tenant), *models)

    async def allowed_models(self, tenant: str) -> set[str]:
        """The models on `tenant`'s access list in Redis."""
        members = await self._redis.smembers(self._keys.auth_models(tenant))
        # The client returns bytes (no decode_responses); its type also allows str.
        return {m.decode() if isinstance(m, bytes) else m for m in members}
