"""The whole stack running as it should in production (`SecureStack`): every
service on its own NATS user with least-privilege permissions, Redis behind a
password, the gateway on TLS only. Predictions still flow, plaintext and
wrong credentials are refused, and no secret reaches a log."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
import redis.exceptions
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferbus_testing.edge import edge_process
from inferbus_testing.examples import make_fraud_model
from inferbus_testing.processes import ServiceError, ServiceProcess
from inferbus_testing.secure import SecureStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    base = tmp_path_factory.mktemp("secure")
    model_dir = base / "fraud-model"
    make_fraud_model(model_dir)
    st = SecureStack(base, workers=1, with_redis=True)
    with st:
        st.push(model_dir, "fraud")
        st.wait_model_ready("fraud")
        yield st


def _x(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)


def test_predictions_over_tls_grpc_and_https(stack: SecureStack) -> None:
    inp = grpcclient.InferInput("input", [2, 64], "FP32")
    inp.set_data_from_numpy(_x(2))
    client = grpcclient.InferenceServerClient(
        stack.grpc_url, ssl=True, root_certificates=str(stack.ca_file)
    )
    out = client.infer("fraud", [inp]).as_numpy("probabilities")
    client.close()
    assert out.shape[0] == 2

    hinp = httpclient.InferInput("input", [3, 64], "FP32")
    hinp.set_data_from_numpy(_x(3))
    hclient = httpclient.InferenceServerClient(
        stack.http_url, ssl=True, ssl_options={"ca_certs": str(stack.ca_file)}
    )
    hout = hclient.infer("fraud", [hinp]).as_numpy("probabilities")
    hclient.close()
    assert hout.shape[0] == 3


def test_plaintext_clients_are_refused(stack: SecureStack) -> None:
    channel = grpc.insecure_channel(stack.grpc_url)
    with pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=2)
    channel.close()
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{stack.http_url}/v2/health/ready", timeout=2)


async def test_redis_requires_the_password(stack: SecureStack) -> None:
    assert stack.redis is not None
    anonymous = aioredis.from_url(stack.redis.url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        await anonymous.ping()
    await anonymous.aclose()
    authed = aioredis.from_url(stack.redis.url, password=stack.redis_password)
    assert await authed.ping()
    # The gateway authenticated too: it registered itself for the limiter.
    keys = [k async for k in authed.scan_iter("ib:*")]
    await authed.aclose()
    assert keys, "the gateway wrote nothing to Redis: did it authenticate?"


def test_service_with_wrong_nats_password_never_serves(stack: SecureStack, tmp_path: Path) -> None:
    bad = tmp_path / "bad-password"
    bad.write_text("not-the-router-password")
    assert stack.nats is not None
    proc = ServiceProcess(
        "inferbus_router",
        name="router-bad",
        env={
            "INFERBUS_ROUTER_NATS_URL": stack.nats.url,
            "INFERBUS_ROUTER_METRICS_PORT": "0",
            "INFERBUS_ROUTER_NATS_USER": "router",
            "INFERBUS_ROUTER_NATS_PASSWORD_FILE": str(bad),
        },
        log_dir=tmp_path,
    )
    # It keeps retrying (a service never gives up on NATS) but never serves.
    try:
        with pytest.raises(ServiceError, match="no ports file"):
            proc.start(timeout=10)
    finally:
        proc.terminate(timeout=5)
        proc.cleanup()
    assert stack.nats is not None
    assert 'authentication error - User "router"' in stack.nats.log_tail(200)


def test_no_secret_in_any_log(stack: SecureStack) -> None:
    secrets = [*stack.passwords.values(), stack.redis_password]
    key = (stack.secrets_dir / "key.pem").read_text().splitlines()[1]
    logs = [p for p in stack.base.rglob("*.log") if "nats" not in p.parts]
    assert logs, "no service logs found"
    for path in logs:
        text = path.read_text(errors="replace")
        for secret in [*secrets, key]:
            assert secret not in text, f"a secret leaked into {path}"


def test_permissions_are_sufficient(stack: SecureStack) -> None:
    """No service of the running stack was refused anything by the broker: the
    permission table covers everything the services do."""
    logs = [p for p in stack.base.glob("*.log")]
    assert logs
    for path in logs:
        text = path.read_text(errors="replace").lower()
        assert "permissions violation" not in text, f"{path.name}: {text[-2000:]}"
        # Gateways' liveness probes reach the workers (noworker.py).
        assert "liveness probes do not reach" not in text, f"{path.name}: {text[-2000:]}"


def _secure_edge(stack: SecureStack, upstream: str, log_dir: Path, **env: str) -> ServiceProcess:
    """A started edge as the NATS user `edge`, serving TLS with the stack's certificate."""
    assert stack.nats is not None
    edge = edge_process(
        stack.nats.url,
        upstream,
        log_dir,
        NATS_USER="edge",
        NATS_PASSWORD_FILE=str(stack.password_file("edge")),
        TLS_CERT_FILE=str(stack.ca_file),
        TLS_KEY_FILE=str(stack.secrets_dir / "key.pem"),
        **env,
    )
    edge.start()
    try:
        edge.wait_ready()
    except BaseException:
        edge.cleanup()
        raise
    return edge


def test_the_edge_serves_tls_as_its_own_nats_user(stack: SecureStack, tmp_path: Path) -> None:
    """The compiled gRPC edge in a secured stack: TLS only on its port, the
    `edge` NATS user (it may only ask the gateways and read its own inbox),
    streams proxied to the gateway's TLS port."""
    edge = _secure_edge(stack, stack.grpc_url, tmp_path, UPSTREAM_CA_FILE=str(stack.ca_file))
    try:
        url = f"127.0.0.1:{edge.ports['grpc']}"
        client = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(stack.ca_file)
        )
        inp = grpcclient.InferInput("input", [4, 64], "FP32")
        inp.set_data_from_numpy(_x(4))
        got = client.infer("fraud", [inp], client_timeout=20)
        assert got.as_numpy("probabilities").shape[0] == 4
        # The stream goes through to the gateway's own port, over TLS too.
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("fraud", [inp], request_id="tls-stream")
        result, error = answers.get(timeout=20)
        client.stop_stream()
        client.close()
        assert error is None, error
        assert result.as_numpy("probabilities").shape[0] == 4

        channel = grpc.insecure_channel(url)
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=2)
        channel.close()

        metrics = stack.metrics(edge)
        assert metrics["inferbus_edge_requests_total{code=OK,method=ModelInfer}"] == 1
        assert metrics["inferbus_edge_proxied_total{code=OK,method=ModelStreamInfer}"] == 1
    finally:
        edge.terminate(timeout=10)
        edge.cleanup()
    log = edge.log_path.read_text(errors="replace")
    assert "serving gRPC (TLS)" in log, log
    assert "permissions violation" not in log.lower(), log
    assert stack.passwords["edge"] not in log
    assert 'User "edge"' not in stack.nats.log_tail(400), "the broker refused the edge something"


def test_the_edge_requires_client_certificates_with_a_client_ca(
    stack: SecureStack, tmp_path: Path
) -> None:
    edge = _secure_edge(stack, "", tmp_path, TLS_CLIENT_CA_FILE=str(stack.ca_file))
    try:
        url = f"127.0.0.1:{edge.ports['grpc']}"
        anonymous = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(stack.ca_file)
        )
        with pytest.raises(InferenceServerException):
            anonymous.is_server_live(client_timeout=5)
        anonymous.close()
        # The test certificate is its own CA: it signs itself as a client's.
        known = grpcclient.InferenceServerClient(
            url,
            ssl=True,
            root_certificates=str(stack.ca_file),
            private_key=str(stack.secrets_dir / "key.pem"),
            certificate_chain=str(stack.ca_file),
        )
        assert known.is_model_ready("fraud", client_timeout=20)
        known.close()
    finally:
        edge.terminate(timeout=10)
        edge.cleanup()
    assert "serving gRPC (mutual TLS)" in edge.log_path.read_text(errors="replace")


async def test_stack_keeps_serving_after_refusals(stack: SecureStack) -> None:
    await asyncio.sleep(0)  # runs last in the module: everything above left the stack healthy
    client = grpcclient.InferenceServerClient(
        stack.grpc_url, ssl=True, root_certificates=str(stack.ca_file)
    )
    assert client.is_model_ready("fraud")
    client.close()


async def test_registry_requires_its_token(stack: SecureStack) -> None:
    from inferbus_client.registry import RegistryClient
    from inferbus_common.errors import PermissionDenied, Unauthenticated

    async with RegistryClient(stack.registry_url) as anonymous:
        with pytest.raises(Unauthenticated, match="INFERBUS_REGISTRY_TOKEN"):
            await anonymous.list_models()
    async with RegistryClient(stack.registry_url, token="forged") as forged:
        with pytest.raises(Unauthenticated, match="not valid"):
            await forged.list_models()
    async with RegistryClient(stack.registry_url, token=stack.reader_token) as reader:
        assert "fraud" in [m.name for m in await reader.list_models()]
        with pytest.raises(PermissionDenied, match="admin token"):
            await reader.set_alias("fraud", "canary", "1")
