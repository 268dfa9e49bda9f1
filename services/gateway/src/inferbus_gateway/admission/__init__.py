"""Admission control: what a request must pass before the gateway sends it on.

Modules, one concern each:

* `auth` — API keys (SHA-256 in Redis), JWT bearer tokens, per-tenant model access;
* `ratelimit` — cluster-wide QPS limits in Redis, spent from local leases, plus a
  per-instance limit; fail-open / fail-closed when Redis is down;
* `quota` — per-tenant request quotas per UTC day and month;
* `breaker` — a circuit breaker per model;
* `fallback` — fixed degraded answers from a model's ``fallback`` config;
* `control` — `Admission`, which builds all of them from `GatewaySettings` and
  runs them in order for each request.

Wiring it into the gateway::

    # __main__.serve(), once, inside the NATS/catalog contexts:
    async with Admission.from_settings(settings, instance) as admission:
        ...  # build the servicer / REST app with `admission`

    # per request (gRPC: dict(context.invocation_metadata()); REST: request.headers)
    principal = await admission.admit(headers, model=model, interface="ModelInfer")
    try:
        response = await service.infer(request_with_tenant(principal.tenant), protocol)
    except BaseException as exc:
        admission.record(model, exc)
        raise
    admission.record(model, None)

Every error raised is an `InferbusError`, so the existing edge mappings apply:
`Unauthenticated` → 401/UNAUTHENTICATED, `PermissionDenied` → 403/PERMISSION_DENIED,
`ResourceExhausted` → 429/RESOURCE_EXHAUSTED with ``retry-after`` and the reason,
`Unavailable` and `breaker.BreakerOpen` → 503/UNAVAILABLE.
"""

from inferbus_common.admission.apikeys import KeyStore
from inferbus_common.admission.limits import Limit, Scope
from inferbus_gateway.admission.auth import Authenticator, JwtVerifier, Principal
from inferbus_gateway.admission.breaker import BreakerBoard, BreakerOpen, CircuitBreaker
from inferbus_gateway.admission.control import Admission
from inferbus_gateway.admission.fallback import FALLBACK_HEADER, fallback_outputs
from inferbus_gateway.admission.quota import QuotaKeeper
from inferbus_gateway.admission.ratelimit import RateLimiter

__all__ = [
    "FALLBACK_HEADER",
    "Admission",
    "Authenticator",
    "BreakerBoard",
    "BreakerOpen",
    "CircuitBreaker",
    "JwtVerifier",
    "KeyStore",
    "Limit",
    "Principal",
    "QuotaKeeper",
    "RateLimiter",
    "Scope",
    "fallback_outputs",
]
