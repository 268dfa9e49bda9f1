"""Triton's repository extension in the gateway: REST routes, access checks, errors.

Real parts: nats-server, an in-process registry (local store), the gateway's
`Catalog` and its `Authenticator` with HS256 JWTs and a configured access
list. No worker runs here, so loads time out with a clear reason; loads that
succeed are covered end to end in tests/e2e/test_e2e_registry_s3.py.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import httpx
import jwt
import nats
import pytest
from starlette.applications import Starlette

from inferbus_client.registry import RegistryClient
from inferbus_common.catalog import Catalog
from inferbus_common.subjects import Subjects
from inferbus_gateway.admission.auth import Authenticator, JwtVerifier
from inferbus_gateway.rest.repository import repository_routes
from inferbus_gateway.triton.repository import RepositoryExtension, parameter_text
from inferbus_registry.app import RegistryApp
from inferbus_registry.settings import RegistrySettings
from inferbus_testing.servers import NatsServer

REPO = Path(__file__).resolve().parents[3]
SECRET = "repository-extension-test-secret-0123456789"


def _token(tenant: str) -> str:
    now = int(time.time())
    return jwt.encode({"sub": "t", "tenant": tenant, "exp": now + 60, "iat": now}, SECRET, "HS256")


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def fraud_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fraud")
    subprocess.run(
        [sys.executable, str(REPO / "examples/fraud/make_model.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture
async def registry(
    tmp_path: Path, nats_server: NatsServer, fraud_model: Path
) -> AsyncIterator[RegistryApp]:
    settings = RegistrySettings(
        nats_url=nats_server.url,
        subject_prefix="g" + secrets.token_hex(4),
        grpc_port=0,
        metrics_port=0,
        store_dir=tmp_path / "store",
        spool_dir=tmp_path,
        use_uvloop=False,
        drain_timeout_s=1.0,
        log_format="text",
    )
    async with RegistryApp(settings) as app:
        model = tmp_path / "fraud"
        model.mkdir()
        for f in ("model.onnx", "config.json"):
            (model / f).write_bytes((fraud_model / f).read_bytes())
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as client:
            await client.push(model, "fraud", "1")
            config = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**config, "name": "churn"}))
            await client.push(model, "churn", "1")
            await client.push(model, "churn", "2", aliases=["stable"])
            await client.archive("churn", "1")
        yield app


@pytest.fixture
async def http(registry: RegistryApp) -> AsyncIterator[httpx.AsyncClient]:
    nc = await nats.connect(registry.settings.nats_url)
    auth = Authenticator(
        store=None,
        jwt_verifier=JwtVerifier(hs_secret=SECRET, algorithms=["HS256"]),
        tenant_models={"acme": ["fraud"], "ops": ["*"]},
    )

    async def authorize(headers: Mapping[str, str], model: str) -> None:
        await auth.authorize(await auth.authenticate(headers), model)

    try:
        async with Catalog(nc.jetstream(), Subjects(registry.settings.subject_prefix)) as catalog:
            await catalog.wait_loaded()
            async with RepositoryExtension(
                catalog, f"127.0.0.1:{registry.grpc_port}", authorize, load_timeout_s=0.5
            ) as ext:
                app = Starlette(routes=repository_routes(ext))
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
                    c.catalog = catalog  # type: ignore[attr-defined]
                    yield c
    finally:
        await nc.close()


def _auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {_token(tenant)}"}


async def test_access_is_checked_like_inference(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v2/repository/index")
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    assert "credentials" in resp.json()["error"]
    # acme sees only the models on its access list, and may not load others.
    rows = (await http.post("/v2/repository/index", headers=_auth("acme"))).json()
    assert {r["name"] for r in rows} == {"fraud"}
    resp = await http.post("/v2/repository/models/churn/unload", headers=_auth("acme"))
    assert resp.status_code == 403


async def test_index_states_and_unload(http: httpx.AsyncClient) -> None:
    rows = (await http.post("/v2/repository/index", headers=_auth("ops"))).json()
    by_key = {(r["name"], r["version"]): r for r in rows}
    assert by_key[("churn", "1")] == {
        "name": "churn",
        "version": "1",
        "state": "UNAVAILABLE",
        "reason": "archived",
    }
    assert by_key[("fraud", "1")]["state"] == "UNAVAILABLE"  # no worker runs here
    assert by_key[("fraud", "1")]["reason"] == "no worker"
    ready = await http.post("/v2/repository/index", headers=_auth("ops"), json={"ready": True})
    assert ready.json() == []

    catalog: Catalog = http.catalog  # type: ignore[attr-defined]
    assert "fraud" in catalog.routes
    resp = await http.post(
        "/v2/repository/models/fraud/unload",
        headers=_auth("acme"),
        json={"parameters": {"unload_dependents": False}},
    )
    assert resp.status_code == 200 and resp.content == b""
    assert "fraud" not in catalog.routes  # the call returns once this gateway stopped routing
    rows = (await http.post("/v2/repository/index", headers=_auth("ops"))).json()
    assert {(r["name"], r["reason"]) for r in rows if r["name"] == "fraud"} == {
        ("fraud", "unloaded")
    }


async def test_load_errors_are_clear(http: httpx.AsyncClient) -> None:
    catalog: Catalog = http.catalog  # type: ignore[attr-defined]
    await http.post("/v2/repository/models/fraud/unload", headers=_auth("ops"))
    resp = await http.post(
        "/v2/repository/models/fraud/load",
        headers=_auth("ops"),
        json={"parameters": {"config": "{}"}},
    )
    assert resp.status_code == 400 and "not supported" in resp.json()["error"]
    resp = await http.post("/v2/repository/models/nope/load", headers=_auth("ops"))
    assert resp.status_code == 404
    resp = await http.post(
        "/v2/repository/models/churn/load",
        headers=_auth("ops"),
        json={"parameters": {"version": "1"}},
    )
    assert resp.status_code == 400 and "archived" in resp.json()["error"]  # FAILED_PRECONDITION
    # No worker: the route is back, but the load reports it is not ready in time.
    resp = await http.post("/v2/repository/models/fraud/load", headers=_auth("ops"))
    assert resp.status_code == 503
    assert "not ready after 0.5s (no worker)" in resp.json()["error"]
    assert "fraud" in catalog.routes
    resp = await http.post("/v2/repository/index", headers=_auth("ops"), content=b"[1]")
    assert resp.status_code == 400


async def test_without_a_registry_address(registry: RegistryApp) -> None:
    nc = await nats.connect(registry.settings.nats_url)
    try:
        async with Catalog(nc.jetstream(), Subjects(registry.settings.subject_prefix)) as catalog:

            async def allow(headers: Mapping[str, str], model: str) -> None:
                return None

            ext = RepositoryExtension(catalog, "", allow)
            app = Starlette(routes=repository_routes(ext))
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw"
            ) as c:
                resp = await c.post("/v2/repository/index")
            assert resp.status_code == 503
            assert "INFERBUS_GATEWAY_REGISTRY_URL" in resp.json()["error"]
    finally:
        await nc.close()


def test_parameter_text() -> None:
    assert parameter_text({"version": "2"}, "version") == "2"
    assert parameter_text({"version": b"2"}, "version") == "2"
    assert parameter_text({}, "version") == ""
    with pytest.raises(Exception, match="must be a string"):
        parameter_text({"version": 2}, "version")
