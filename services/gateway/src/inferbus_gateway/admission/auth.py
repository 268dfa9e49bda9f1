"""Who is calling, and may they call this model: API keys, JWT bearer tokens, access lists.

**API keys** are random strings (``ib_…``) shown once when created; Redis keeps
only their SHA-256 (hash ``<prefix>:auth:keys``: digest → JSON ``{tenant,
key_id, created, revoked}``, and ``<prefix>:auth:key-ids``: key id → digest), so
a copy of Redis reveals no usable key. A tenant may hold several keys; a
revoked key stops working within `cache_ttl_s` (≤ 1 s) on every gateway,
without a restart.

**JWT bearer tokens** (PyJWT) are checked for signature, ``exp`` (required),
``nbf``, ``aud`` and ``iss``; HS256 uses a shared secret, RS256/ES256 a PEM
public key or a JWKS file (key chosen by the token's ``kid``). The tenant is
read from a configurable claim (``tenant`` by default).

**Access lists**: a tenant may call the models in the Redis set
``<prefix>:auth:models:<tenant>`` plus those its settings list; ``*`` means
every model. A tenant with no list may call nothing.

Clients send ``authorization: Bearer <api key or JWT>`` or ``x-api-key: <api
key>``. Secrets are never logged: log lines name a key by its id, never by its
value or digest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jwt
from prometheus_client import Counter

from inferbus_common.admission.apikeys import (
    ALL_MODELS,
    API_KEY_PREFIX,
    ApiKeyRecord,
    KeyStore,
    hash_api_key,
)
from inferbus_common.admission.keys import REDIS_DOWN_ERRORS, reraise_if_cancelling
from inferbus_common.errors import PermissionDenied, Unauthenticated, Unavailable

log = logging.getLogger(__name__)

AUTH_REJECTED = Counter(
    "inferbus_gateway_auth_rejected_total",
    "Requests refused by authentication or model access checks, by reason.",
    ["reason"],
)

MAX_CACHE_TTL_S = 1.0
_CACHE_LIMIT = 50_000

Method = Literal["api-key", "jwt", "none"]


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller.

    Attributes:
        tenant: the tenant the request is accounted to.
        key_id: the API key's id or the JWT's ``sub`` (never a secret).
        method: how it authenticated (``none`` when auth is disabled).
    """

    tenant: str
    key_id: str
    method: Method


ANONYMOUS = Principal(tenant="anonymous", key_id="", method="none")


class JwtVerifier:
    """Checks JWT bearer tokens and reads the tenant from them.

    Args:
        algorithms: accepted ``alg`` values (``HS256``, ``RS256``, ``ES256`` ...).
        hs_secret: shared secret for HS* tokens.
        public_key: PEM public key for RS*/ES* tokens.
        jwks: JSON Web Key Set for RS*/ES* tokens (chosen by ``kid``).
        audience: required ``aud`` (empty: tokens must carry no ``aud``).
        issuer: required ``iss`` (empty: not checked).
        tenant_claim: claim holding the tenant.
        leeway_s: clock skew allowed on ``exp``/``nbf``.
    """

    def __init__(
        self,
        *,
        algorithms: Sequence[str] = ("HS256", "RS256", "ES256"),
        hs_secret: str = "",
        public_key: str = "",
        jwks: Mapping[str, Any] | None = None,
        audience: str = "",
        issuer: str = "",
        tenant_claim: str = "tenant",
        leeway_s: float = 0.0,
    ) -> None:
        if "none" in {a.lower() for a in algorithms}:
            raise ValueError("the 'none' algorithm is never accepted")
        self._algorithms = frozenset(algorithms)
        self._hs_secret = hs_secret
        self._public_key = public_key
        self._jwks = jwt.PyJWKSet.from_dict(dict(jwks)) if jwks else None
        self._audience = audience
        self._issuer = issuer
        self._tenant_claim = tenant_claim
        self._leeway_s = leeway_s
        if not (hs_secret or public_key or jwks):
            raise ValueError("a JWT verifier needs an HS secret, a public key or a JWKS")

    @classmethod
    def from_files(
        cls,
        *,
        public_key_file: Path | None = None,
        jwks_file: Path | None = None,
        **kwargs: Any,
    ) -> JwtVerifier:
        """Build one reading the PEM public key and/or JWKS from files."""
        public_key = public_key_file.read_text() if public_key_file else ""
        jwks = json.loads(jwks_file.read_text()) if jwks_file else None
        return cls(public_key=public_key, jwks=jwks, **kwargs)

    def _key_for(self, header: Mapping[str, Any]) -> Any:
        alg = header.get("alg", "")
        if alg.startswith("HS"):
            if not self._hs_secret:
                raise Unauthenticated("invalid token: HMAC-signed tokens are not accepted")
            return self._hs_secret
        kid = header.get("kid")
        if self._jwks is not None and kid:
            try:
                return self._jwks[kid].key
            except KeyError:
                raise Unauthenticated("invalid token: unknown signing key (kid)") from None
        if self._public_key:
            return self._public_key
        raise Unauthenticated("invalid token: no key to verify it")

    def verify(self, token: str) -> Principal:
        """Check a token and return its principal.

        Raises:
            Unauthenticated: bad signature, expired, not yet valid, wrong
                audience or issuer, unsupported algorithm, or no tenant claim.
        """
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise Unauthenticated("invalid token: not a JWT") from None
        alg = header.get("alg", "")
        if alg not in self._algorithms:
            raise Unauthenticated(f"invalid token: algorithm {alg!r} is not accepted")
        key = self._key_for(header)
        required = ["exp"]
        if self._audience:
            required.append("aud")
        if self._issuer:
            required.append("iss")
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=self._audience or None,
                issuer=self._issuer or None,
                leeway=self._leeway_s,
                options={"require": required},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("invalid token: expired") from None
        except jwt.ImmatureSignatureError:
            raise Unauthenticated("invalid token: not valid yet (nbf)") from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated("invalid token: wrong audience") from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated("invalid token: wrong issuer") from None
        except jwt.MissingRequiredClaimError as exc:
            raise Unauthenticated(f"invalid token: missing claim '{exc.claim}'") from None
        except jwt.InvalidSignatureError:
            raise Unauthenticated("invalid token: bad signature") from None
        except (jwt.PyJWTError, ValueError, TypeError):
            raise Unauthenticated("invalid token") from None
        tenant = claims.get(self._tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise Unauthenticated(f"invalid token: no '{self._tenant_claim}' claim")
        return Principal(tenant=tenant, key_id=str(claims.get("sub", "")), method="jwt")


_disabled_warned = False


def credentials_from(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """Find the credentials in request headers / gRPC metadata.

    Args:
        headers: header names in lower case (gRPC metadata already is; pass
            Starlette's case-insensitive ``request.headers`` as they are).

    Returns:
        (``api-key`` or ``bearer``, the secret), or None when there are none.
    """
    auth = headers.get("authorization", "")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and value:
            if value.startswith(API_KEY_PREFIX):
                return "api-key", value
            return "bearer", value
    key = headers.get("x-api-key", "").strip()
    if key:
        return "api-key", key
    return None


class Authenticator:
    """Authentication and model access checks for every request.

    Args:
        store: API keys and access lists (None: API keys are not accepted).
        jwt_verifier: JWT checks (None: JWTs are not accepted).
        enabled: False turns all checks off (logged loudly once).
        tenant_models: access lists from settings, added to those in Redis.
        cache_ttl_s: how long a key lookup or access list is reused (≤ 1 s), so
            revocations and access changes apply within it.
        clock: monotonic clock.
    """

    def __init__(
        self,
        *,
        store: KeyStore | None,
        jwt_verifier: JwtVerifier | None = None,
        enabled: bool = True,
        tenant_models: Mapping[str, Sequence[str]] | None = None,
        cache_ttl_s: float = MAX_CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        global _disabled_warned
        if not 0 <= cache_ttl_s <= MAX_CACHE_TTL_S:
            raise ValueError(f"cache_ttl_s must be within [0, {MAX_CACHE_TTL_S}]")
        self.enabled = enabled
        self._store = store
        self._jwt = jwt_verifier
        self._tenant_models = {t: frozenset(ms) for t, ms in (tenant_models or {}).items()}
        self._ttl = cache_ttl_s
        self._clock = clock
        self._keys_cache: dict[str, tuple[float, ApiKeyRecord | None]] = {}
        self._models_cache: dict[str, tuple[float, frozenset[str]]] = {}
        if not enabled and not _disabled_warned:
            _disabled_warned = True
            log.warning(
                "AUTHENTICATION IS DISABLED: every request is accepted as tenant 'anonymous' "
                "and may call every model. Never run like this where untrusted clients "
                "can reach the gateway (set INFERBUS_GATEWAY_AUTH_ENABLED=true)."
            )

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """Identify the caller from request headers.

        Raises:
            Unauthenticated: no, unknown, revoked or invalid credentials.
            Unavailable: Redis cannot be reached and the key is not cached.
        """
        if not self.enabled:
            return ANONYMOUS
        creds = credentials_from(headers)
        if creds is None:
            AUTH_REJECTED.labels("missing").inc()
            raise Unauthenticated(
                "missing credentials: send 'authorization: Bearer <token>' or 'x-api-key: <key>'"
            )
        kind, secret = creds
        if kind == "bearer":
            if self._jwt is None:
                AUTH_REJECTED.labels("invalid-token").inc()
                raise Unauthenticated("invalid credentials: bearer tokens (JWT) are not accepted")
            try:
                return self._jwt.verify(secret)
            except Unauthenticated as exc:
                AUTH_REJECTED.labels("invalid-token").inc()
                log.info("request rejected: %s", exc.message)
                raise
        record = await self._lookup_key(secret)
        if record is None:
            AUTH_REJECTED.labels("invalid-key").inc()
            log.info("request rejected: unknown API key")
            raise Unauthenticated("invalid API key")
        if record.revoked:
            AUTH_REJECTED.labels("revoked-key").inc()
            log.info("request rejected: API key %s is revoked", record.key_id)
            raise Unauthenticated(f"API key '{record.key_id}' has been revoked")
        return Principal(tenant=record.tenant, key_id=record.key_id, method="api-key")

    async def _lookup_key(self, secret: str) -> ApiKeyRecord | None:
        if self._store is None:
            raise Unauthenticated("invalid credentials: API keys are not accepted")
        digest = hash_api_key(secret)
        now = self._clock()
        cached = self._keys_cache.get(digest)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            record = await self._store.lookup(secret)
        except REDIS_DOWN_ERRORS:
            reraise_if_cancelling()
            if cached is not None:  # stale, but better than refusing everyone
                return cached[1]
            raise Unavailable("cannot check credentials right now; retry shortly") from None
        if len(self._keys_cache) > _CACHE_LIMIT:
            self._keys_cache.clear()
        self._keys_cache[digest] = (now + self._ttl, record)
        return record

    async def authorize(self, principal: Principal, model: str) -> None:
        """Check that `principal` may call `model`.

        Raises:
            PermissionDenied: the model is not on the tenant's access list.
            Unavailable: Redis cannot be reached and the list is not cached.
        """
        if not self.enabled or principal.method == "none":
            return
        allowed = await self._allowed(principal.tenant)
        if ALL_MODELS in allowed or model in allowed:
            return
        AUTH_REJECTED.labels("model-not-allowed").inc()
        log.info(
            "request rejected: tenant %s may not call model %s",
            principal.tenant,
            model,
            extra={"tenant": principal.tenant, "model": model},
        )
        raise PermissionDenied(f"tenant '{principal.tenant}' may not call model '{model}'")

    async def may_call(self, principal: Principal, model: str) -> bool:
        """Whether `principal` may call `model`: `authorize` without the refusal
        (for listings, which leave out what the caller may not call).

        Raises:
            Unavailable: Redis cannot be reached and the list is not cached.
        """
        if not self.enabled or principal.method == "none":
            return True
        allowed = await self._allowed(principal.tenant)
        return ALL_MODELS in allowed or model in allowed

    async def _allowed(self, tenant: str) -> frozenset[str]:
        now = self._clock()
        cached = self._models_cache.get(tenant)
        if cached is not None and cached[0] > now:
            return cached[1]
        static = self._tenant_models.get(tenant, frozenset())
        if self._store is None:
            return static
        try:
            dynamic = await self._store.allowed_models(tenant)
        except REDIS_DOWN_ERRORS:
            reraise_if_cancelling()
            if cached is not None:
                return cached[1]
            if static:
                return static
            raise Unavailable("cannot check model access right now; retry shortly") from None
        allowed = static | dynamic
        if len(self._models_cache) > _CACHE_LIMIT:
            self._models_cache.clear()
        self._models_cache[tenant] = (now + self._ttl, allowed)
        return allowed
