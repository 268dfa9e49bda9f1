"""`Admission`: the gateway's front door, built once from settings.

One call per request, in this order, each step cheaper to fail than the next:

1. authenticate (API key or JWT) → `Unauthenticated`;
2. authorize the tenant for the model → `PermissionDenied`;
3. the model's circuit breaker → `BreakerOpen` (an `Unavailable`);
4. QPS limits: per instance, then cluster-wide → `ResourceExhausted` with
   reason ``instance-qps`` / ``cluster-qps`` / ``model-qps`` / ``tenant-quota``
   (or `Unavailable` when Redis is down and the mode is fail-closed);
5. the tenant's day/month quota → `ResourceExhausted` reason ``tenant-quota``.

A request refused at step 4 or 5 does not use quota; one refused at 3 uses
no tokens. After a request that passed, the gateway reports its outcome with
`Admission.record`, which feeds the breaker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_gateway.admission.auth import Authenticator, JwtVerifier, Principal
from inferbus_gateway.admission.breaker import BreakerBoard
from inferbus_gateway.admission.quota import QuotaKeeper
from inferbus_gateway.admission.ratelimit import RateLimiter
from inferbus_gateway.admission.tokens import TokenLimiter
from inferbus_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class Admission:
    """Every check a request passes before the gateway sends it into the platform.

    Args:
        authenticator: identifies callers and checks model access.
        limiter: QPS limits (None: no limits).
        quotas: tenant quotas (None: no quotas).
        breakers: per-model circuit breakers (None: no breakers).
    """

    def __init__(
        self,
        authenticator: Authenticator,
        *,
        limiter: RateLimiter | None = None,
        quotas: QuotaKeeper | None = None,
        breakers: BreakerBoard | None = None,
        tokens: TokenLimiter | None = None,
    ) -> None:
        self.authenticator = authenticator
        self.tokens = tokens
        """Tokens-per-minute limits of generative requests (None: none; needs Redis)."""
        self.limiter = limiter
        self.quotas = quotas
        self.breakers = breakers

    @classmethod
    @contextlib.asynccontextmanager
    async def from_settings(
        cls, settings: GatewaySettings, instance_id: str
    ) -> AsyncIterator[Admission]:
        """Build, start and (on exit) stop admission control from gateway settings.

        Without ``redis_url`` there are no API keys, limits or quotas: only JWTs,
        access lists from settings and breakers work.

        Raises:
            ValueError: auth is enabled but no way to authenticate is configured.
        """
        keys = AdmissionKeys(settings.redis_key_prefix)
        redis = (
            connect_redis(
                settings.redis_url,
                timeout_s=settings.redis_timeout_s,
                password=settings.redis_secret(),
            )
            if (settings.redis_url)
            else None
        )
        try:
            verifier = None
            hs_secret = (
                settings.auth_jwt_hs_secret.get_secret_value()
                if settings.auth_jwt_hs_secret
                else ""
            )
            if hs_secret or settings.auth_jwt_public_key_file or settings.auth_jwt_jwks_file:
                verifier = JwtVerifier.from_files(
                    public_key_file=settings.auth_jwt_public_key_file,
                    jwks_file=settings.auth_jwt_jwks_file,
                    algorithms=settings.auth_jwt_algorithms,
                    hs_secret=hs_secret,
                    audience=settings.auth_jwt_audience,
                    issuer=settings.auth_jwt_issuer,
                    tenant_claim=settings.auth_jwt_tenant_claim,
                    leeway_s=settings.auth_jwt_leeway_s,
                )
            store = KeyStore(redis, keys) if redis is not None else None
            if settings.auth_enabled and store is None and verifier is None:
                raise ValueError(
                    "auth is enabled but neither Redis (API keys) nor a JWT key is configured"
                )
            authenticator = Authenticator(
                store=store,
                jwt_verifier=verifier,
                enabled=settings.auth_enabled,
                tenant_models=settings.auth_tenant_models,
                cache_ttl_s=settings.auth_cache_ttl_s,
            )
            breakers = (
                BreakerBoard(
                    window_s=settings.breaker_window_s,
                    min_requests=settings.breaker_min_requests,
                    failure_rate=settings.breaker_failure_rate,
                    open_s=settings.breaker_open_s,
                    half_open_probes=settings.breaker_half_open_probes,
                )
                if settings.breaker_enabled
                else None
            )
            if redis is None:
                yield cls(authenticator, breakers=breakers)
                return
            quotas = QuotaKeeper(redis, keys, failure_mode=settings.ratelimit_failure_mode)
            limiter = RateLimiter(
                redis,
                keys,
                instance_id=instance_id,
                failure_mode=settings.ratelimit_failure_mode,
                instance_qps=settings.ratelimit_instance_qps,
                instance_burst=settings.ratelimit_instance_burst,
                lease_ttl_s=settings.ratelimit_lease_ttl_s,
                reload_interval_s=settings.ratelimit_reload_interval_s,
                gateway_ttl_s=settings.ratelimit_gateway_ttl_s,
            )
            tokens = TokenLimiter(
                redis, keys.prefix, reload_interval_s=settings.ratelimit_reload_interval_s
            )
            async with limiter, tokens:
                yield cls(
                    authenticator,
                    limiter=limiter,
                    quotas=quotas,
                    breakers=breakers,
                    tokens=tokens,
                )
        finally:
            if redis is not None:
                await redis.aclose()

    async def admit(
        self, headers: Mapping[str, str], *, model: str, interface: str = "ModelInfer"
    ) -> Principal:
        """Run every check for one request.

        Args:
            headers: HTTP headers or gRPC invocation metadata (lower-case names).
            model: the model the request names.
            interface: the API called (``ModelInfer``, ``ModelMetadata`` ...), for
                interface limits.

        Returns:
            The caller; put ``principal.tenant`` on the request (``Ib-Tenant``).

        Raises:
            Unauthenticated, PermissionDenied, BreakerOpen, ResourceExhausted,
            Unavailable: see the module docstring for which check raises which.
        """
        principal = await self.authenticator.authenticate(headers)
        await self.authenticator.authorize(principal, model)
        breaker = self.breakers.get(model) if self.breakers is not None else None
        if breaker is not None:
            breaker.allow()
        try:
            if self.limiter is not None:
                await self.limiter.acquire(
                    interface=interface, model=model, tenant=principal.tenant
                )
            if self.quotas is not None:
                await self.quotas.check(principal.tenant)
        except BaseException as exc:
            if breaker is not None:
                breaker.record(exc)  # frees a half-open probe slot; not counted
            raise
        return principal

    def record(self, model: str, exc: BaseException | None) -> None:
        """Report the outcome of an admitted request (None = success) to the breaker."""
        if self.breakers is not None:
            self.breakers.get(model).record(exc)
