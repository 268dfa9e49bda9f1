"""Admission control: what a request must pass before the gateway sends it on.

`auth` (API keys, JWT, model access), `ratelimit` (cluster QPS limits),
`quota` (per-tenant day/month quotas), `tokens` (tokens per minute),
`breaker` (a circuit breaker per model), `fallback` (degraded answers), and
`control.Admission`, which builds them from `GatewaySettings` and runs them
in order. Every refusal is an `InferbusError`. See docs/architecture.md
("Admission at the gateway").
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
