"""Authentication and access lists against a real redis-server: mostly ways in that fail."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from inferbus_common.admission.apikeys import KeyStore, hash_api_key
from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.errors import PermissionDenied, Unauthenticated, Unavailable
from inferbus_gateway.admission.auth import (
    ANONYMOUS,
    Authenticator,
    JwtVerifier,
    Principal,
    credentials_from,
)
from inferbus_testing.servers import RedisServer

KEYS = AdmissionKeys("t")
HS_SECRET = "s3cret-hmac-key-for-tests-0123456789abcdef"


class Clock:
    """Monotonic clock moved by hand (for the cache TTL)."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[KeyStore]:
    client = connect_redis(redis_server.url)
    try:
        yield KeyStore(client, KEYS)
    finally:
        await client.aclose()


def token(key: object, alg: str = "HS256", **claims: object) -> str:
    now = int(time.time())
    body: dict[str, object] = {
        "sub": "svc-1",
        "tenant": "acme",
        "aud": "inferbus",
        "iss": "https://idp.test",
        "exp": now + 60,
        "iat": now,
    }
    body.update(claims)
    headers = {"kid": "k1"} if alg != "HS256" else None
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, alg, headers)  # type: ignore[arg-type]


def verifier(**kw: object) -> JwtVerifier:
    options: dict[str, object] = {
        "hs_secret": HS_SECRET,
        "audience": "inferbus",
        "issuer": "https://idp.test",
    }
    options.update(kw)
    return JwtVerifier(**options)  # type: ignore[arg-type]


async def test_api_keys_round_trip_and_storage(store: KeyStore, redis_server: RedisServer) -> None:
    rec1, key1 = await store.create_key("acme", key_id="ci")
    _, key2 = await store.create_key("acme")
    _, key3 = await store.create_key("globex")
    assert key1.startswith("ib_") and len({key1, key2, key3}) == 3
    auth = Authenticator(store=store)
    for key, tenant in ((key1, "acme"), (key2, "acme"), (key3, "globex")):
        p = await auth.authenticate({"x-api-key": key})
        assert p.tenant == tenant and p.method == "api-key"
    assert await auth.authenticate({"authorization": f"Bearer {key1}"}) == Principal(
        "acme", "ci", "api-key"
    )
    # Only digests are stored.
    client = connect_redis(redis_server.url)
    stored = await client.hgetall(KEYS.auth_keys)
    await client.aclose()
    assert hash_api_key(key1).encode() in stored
    assert all(key1.encode() not in k + v for k, v in stored.items())
    assert json.loads(stored[hash_api_key(key1).encode()])["key_id"] == "ci"
    acme_ids = [r.key_id for r in await store.list_keys("acme")]
    assert rec1.key_id == "ci" and "ci" in acme_ids and len(acme_ids) == 2
    assert len(await store.list_keys()) == 3
    with pytest.raises(ValueError, match="already exists"):
        await store.create_key("acme", key_id="ci")


async def test_missing_and_wrong_keys(store: KeyStore) -> None:
    await store.create_key("acme")
    auth = Authenticator(store=store)
    for headers in ({}, {"authorization": "Basic abc"}, {"x-api-key": "  "}):
        with pytest.raises(Unauthenticated, match="missing credentials"):
            await auth.authenticate(headers)
    with pytest.raises(Unauthenticated, match="invalid API key"):
        await auth.authenticate({"x-api-key": "ib_not-a-real-key"})
    with pytest.raises(Unauthenticated, match="JWT"):
        await auth.authenticate({"authorization": "Bearer eyJhbGciOi.x.y"})


async def test_revocation_applies_within_the_cache_ttl(store: KeyStore) -> None:
    clock = Clock()
    _rec, key = await store.create_key("acme", key_id="laptop")
    _, other = await store.create_key("acme", key_id="server")
    auth = Authenticator(store=store, clock=clock)
    await auth.authenticate({"x-api-key": key})
    assert await store.revoke_key("laptop")
    assert not await store.revoke_key("laptop")
    assert not await store.revoke_key("nope")
    clock.now += 0.5
    await auth.authenticate({"x-api-key": key})  # still cached, for under a second
    clock.now += 0.5
    with pytest.raises(Unauthenticated, match="'laptop' has been revoked"):
        await auth.authenticate({"x-api-key": key})
    assert (await auth.authenticate({"x-api-key": other})).key_id == "server"
    assert [r.revoked is not None for r in await store.list_keys("acme")] == [True, False]


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        ({"exp": int(time.time()) - 10}, "expired"),
        ({"nbf": int(time.time()) + 3600}, "not valid yet"),
        ({"aud": "someone-else"}, "wrong audience"),
        ({"aud": None}, "missing claim 'aud'"),
        ({"iss": "https://evil.test"}, "wrong issuer"),
        ({"exp": None}, "missing claim 'exp'"),
        ({"tenant": None}, "no 'tenant' claim"),
    ],
)
def test_jwt_claims_are_checked(claims: dict[str, object], message: str) -> None:
    with pytest.raises(Unauthenticated, match=message):
        verifier().verify(token(HS_SECRET, **claims))


def test_jwt_forged_or_unsupported() -> None:
    v = verifier()
    assert v.verify(token(HS_SECRET)) == Principal("acme", "svc-1", "jwt")
    with pytest.raises(Unauthenticated, match="bad signature"):
        v.verify(token("another-secret-of-sufficient-length-000000"))
    good = token(HS_SECRET)
    head, _body, sig = good.split(".")
    forged_body = jwt.utils.base64url_encode(
        json.dumps(
            {**jwt.decode(good, options={"verify_signature": False}), "tenant": "globex"}
        ).encode()
    ).decode()
    with pytest.raises(Unauthenticated, match="bad signature"):
        v.verify(f"{head}.{forged_body}.{sig}")
    unsigned = jwt.encode({"tenant": "acme", "exp": int(time.time()) + 60}, None, "none")
    with pytest.raises(Unauthenticated, match="not accepted"):
        v.verify(unsigned)
    with pytest.raises(Unauthenticated, match="not a JWT"):
        v.verify("garbage")
    with pytest.raises(ValueError):
        JwtVerifier(algorithms=["none"], hs_secret="x")


def _pem_public(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def test_jwt_rs256_es256_with_pem_and_jwks(tmp_path: Path) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "pub.pem"
    pem.write_text(_pem_public(rsa_key))
    v = JwtVerifier.from_files(
        public_key_file=pem, audience="inferbus", issuer="https://idp.test", hs_secret=""
    )
    assert v.verify(token(rsa_key, "RS256")).tenant == "acme"
    with pytest.raises(Unauthenticated, match="HMAC"):
        v.verify(token(HS_SECRET))
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with pytest.raises(Unauthenticated, match="bad signature"):
        v.verify(token(other, "RS256"))

    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "alg": "ES256", "use": "sig"}]}))
    v = JwtVerifier.from_files(
        jwks_file=jwks, audience="inferbus", issuer="https://idp.test", tenant_claim="org"
    )
    assert v.verify(token(ec_key, "ES256", org="initech")).tenant == "initech"
    with pytest.raises(Unauthenticated, match="bad signature"):
        v.verify(token(ec.generate_private_key(ec.SECP256R1()), "ES256", org="initech"))
    unknown_kid = jwt.encode(
        {"org": "x", "exp": int(time.time()) + 9, "aud": "inferbus", "iss": "https://idp.test"},
        ec_key,
        "ES256",
        {"kid": "k9"},
    )
    with pytest.raises(Unauthenticated, match="unknown signing key"):
        v.verify(unknown_kid)


async def test_tenant_may_only_call_its_models(store: KeyStore) -> None:
    clock = Clock()
    _, acme_key = await store.create_key("acme")
    _, globex_key = await store.create_key("globex")
    await store.allow_models("acme", "fraud")
    auth = Authenticator(store=store, tenant_models={"globex": ["churn"]}, clock=clock)
    acme = await auth.authenticate({"x-api-key": acme_key})
    globex = await auth.authenticate({"x-api-key": globex_key})
    await auth.authorize(acme, "fraud")
    await auth.authorize(globex, "churn")
    with pytest.raises(PermissionDenied, match="tenant 'acme' may not call model 'churn'"):
        await auth.authorize(acme, "churn")
    with pytest.raises(PermissionDenied, match="tenant 'globex' may not call model 'fraud'"):
        await auth.authorize(globex, "fraud")
    # Access changes apply within the cache TTL, without restart.
    await store.allow_models("acme", "*")
    clock.now += 1.0
    await auth.authorize(acme, "churn")
    await store.disallow_models("acme", "*")
    assert await store.allowed_models("acme") == {"fraud"}
    jwt_auth = Authenticator(store=store, jwt_verifier=verifier(), clock=clock)
    p = await jwt_auth.authenticate(
        {"authorization": f"Bearer {token(HS_SECRET, tenant='globex')}"}
    )
    with pytest.raises(PermissionDenied):
        await jwt_auth.authorize(p, "fraud")


async def test_redis_down_serves_cached_keys_only(
    store: KeyStore, redis_server: RedisServer
) -> None:
    clock = Clock()
    _, key = await store.create_key("acme")
    _, other = await store.create_key("acme")
    auth = Authenticator(store=store, clock=clock)
    await auth.authenticate({"x-api-key": key})
    redis_server.kill()
    clock.now += 5
    assert (await auth.authenticate({"x-api-key": key})).tenant == "acme"
    with pytest.raises(Unavailable):
        await auth.authenticate({"x-api-key": other})


async def test_disabled_mode_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    from inferbus_gateway.admission import auth as auth_module

    auth_module._disabled_warned = False
    with caplog.at_level(logging.WARNING, logger="inferbus_gateway.admission.auth"):
        a = Authenticator(store=None, enabled=False)
        Authenticator(store=None, enabled=False)
    warnings = [r for r in caplog.records if "AUTHENTICATION IS DISABLED" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert await a.authenticate({}) == ANONYMOUS
    await a.authorize(ANONYMOUS, "anything")


async def test_secrets_are_never_logged(store: KeyStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _, key = await store.create_key("acme", key_id="k-log")
    auth = Authenticator(store=store, jwt_verifier=verifier())
    await auth.authenticate({"x-api-key": key})
    wrong = "ib_wrong-key-value-that-must-not-appear"
    expired = token(HS_SECRET, exp=int(time.time()) - 5)
    forged = token("not-the-secret-but-long-enough-0000000000")
    for headers in ({"x-api-key": wrong}, {"authorization": f"Bearer {expired}"},
                    {"authorization": f"Bearer {forged}"}):  # fmt: skip
        with pytest.raises(Unauthenticated):
            await auth.authenticate(headers)
    await store.revoke_key("k-log")
    with pytest.raises(Unauthenticated):
        await Authenticator(store=store).authenticate({"x-api-key": key})
    text = caplog.text + "".join(repr(r.args) for r in caplog.records)
    assert caplog.records, "rejections are logged"
    for secret in (key, wrong, expired, forged, HS_SECRET, hash_api_key(key)):
        assert secret not in text
        assert secret[-20:] not in text


def test_credentials_from_headers() -> None:
    assert credentials_from({"authorization": "Bearer ib_abc"}) == ("api-key", "ib_abc")
    assert credentials_from({"authorization": "bearer a.b.c"}) == ("bearer", "a.b.c")
    assert credentials_from({"x-api-key": "ib_x"}) == ("api-key", "ib_x")
    assert credentials_from({"authorization": "Bearer "}) is None
