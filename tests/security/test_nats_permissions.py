"""The broker enforces who may say what: a real nats-server configured with
`inferbus_common.security`'s users refuses wrong credentials and every
publish or subscribe outside a service's permissions."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from inferbus_common import bus, security
from inferbus_common.bus import connect
from inferbus_common.subjects import Subjects
from inferbus_testing.servers import NatsServer

pytestmark = pytest.mark.integration

SUBJECTS = Subjects()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, dict]]:
    base = tmp_path_factory.mktemp("secured")
    passwords = security.generate(base / "secrets", SUBJECTS)
    server = NatsServer(base / "nats", extra_args=["-c", str(base / "secrets/nats-auth.conf")])
    with server:
        yield server, passwords


class Conn:
    """A connection as one role, collecting the asynchronous errors the broker sends."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def violation(self, timeout: float = 3.0) -> str:
        """Wait for a 'Permissions Violation' error and return it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            found = [e for e in self.errors if "permissions violation" in e.lower()]
            if found:
                return found[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation; errors: {self.errors}")


@pytest.fixture
async def as_role(secured) -> AsyncIterator:
    server, passwords = secured
    opened: list[Client] = []

    async def _open(role: str) -> Conn:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            server.url,
            user=role,
            password=passwords[role],
            inbox_prefix=security.inbox_prefix(role),
            error_cb=on_error,
            allow_reconnect=False,
        )
        opened.append(nc)
        return Conn(nc, errors)

    yield _open
    for nc in opened:
        await nc.close()


async def _delivered(listener: Client, subject: str, publish, attempts: int = 5) -> bool:
    """Whether a publish made by `publish()` reaches an admin subscriber on `subject`."""
    got = asyncio.Event()

    async def on_msg(_msg) -> None:
        got.set()

    sub = await listener.subscribe(subject, cb=on_msg)
    await bus.sync(listener)
    # nats-server may drop the first message right after a fresh SUB from
    # another connection; publish a few times.
    for _ in range(attempts):
        await publish()
        try:
            await asyncio.wait_for(got.wait(), 0.3)
            break
        except TimeoutError:
            continue
    await sub.unsubscribe()
    return got.is_set()


def _connect_raw(port: int, **auth: str) -> str:
    """Speak the NATS protocol by hand: CONNECT with `auth`, PING; return the server's answer.

    (nats-py leaks the socket of a refused connection, which pytest reports.)
    """
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.recv(4096)  # INFO
        connect = {"verbose": False, "pedantic": False, "protocol": 1, **auth}
        sock.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        return sock.recv(4096).decode(errors="replace")


def test_wrong_password_is_refused(secured) -> None:
    server, passwords = secured
    assert "Authorization Violation" in _connect_raw(server.port, user="worker", **{"pass": "x"})
    assert "PONG" in _connect_raw(server.port, user="worker", **{"pass": passwords["worker"]})


def test_no_credentials_is_refused(secured) -> None:
    server, _ = secured
    assert "Authorization Violation" in _connect_raw(server.port)


@pytest.mark.parametrize(
    ("role", "subject", "why"),
    [
        ("worker", f"$KV.{SUBJECTS.routes_bucket}.fraud", "only the registry writes routes"),
        ("worker", f"$KV.{SUBJECTS.models_bucket}.fraud.1", "only the registry writes versions"),
        ("gateway", f"$KV.{SUBJECTS.routes_bucket}.fraud", "only the registry writes routes"),
        ("gateway", "ib.reply.gw-1.7", "only answering services publish replies"),
        ("gateway", "ib.batch.default.fraud.1", "only the batcher writes the work queue"),
        ("worker", "ib.route.fraud", "only gateways send requests in"),
        ("worker", "ib.genroute.llm", "only gateways send generative requests in"),
        ("batcher", "ib.route.fraud", "a batcher does not send requests in"),
        ("worker", "ib.seq.w-2.acc.1", "only gateways send sequence requests"),
        ("router", "ib.seqwho.acc.1", "only gateways look for sequences"),
        ("router", "ib.alive.w-2", "only gateways probe workers"),
        ("router", "ib.events.registry.fraud", "only the registry announces lifecycle events"),
        ("batcher", f"$JS.API.STREAM.DELETE.{SUBJECTS.batch_stream}", "no one deletes streams"),
        ("worker", f"$JS.API.STREAM.PURGE.KV_{SUBJECTS.routes_bucket}", "no route purges"),
        ("edge", "ib.route.fraud", "the edge only asks the gateways' queue group"),
        ("edge", "ib.fast.w-1", "the edge does not reach workers"),
        ("edge", f"$KV.{SUBJECTS.routes_bucket}.fraud", "the edge writes no catalog"),
        ("worker", "ib.edge.grpc", "only the edge sends gRPC calls to the gateways"),
        ("worker", "_INBOX_edge.abc.r", "only gateways answer the edge"),
    ],
)
async def test_publish_outside_permissions_is_refused(
    secured, as_role, role: str, subject: str, why: str
) -> None:
    conn = await as_role(role)
    admin = await as_role("admin")
    forge = lambda: conn.nc.publish(subject, b"forged")  # noqa: E731
    delivered = await _delivered(admin.nc, subject, forge, attempts=2)
    assert not delivered, f"{role} could publish on {subject} ({why})"
    assert subject.lower() in await conn.violation()


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        ("worker", "ib.route.>"),  # a worker may not read requests with their tenants
        ("worker", "ib.genroute.>"),  # nor prompts
        ("gateway", "ib.infer.>"),
        ("batcher", "ib.reply.>"),  # answers are for gateways only
        ("router", "_INBOX_registry.>"),  # another service's JetStream answers
        ("batcher", "ib.seq.>"),  # requests of sequences are for workers only
        ("edge", "ib.edge.grpc"),  # the edge asks; only gateways take the calls
        ("edge", "_INBOX_gateway.>"),
        ("worker", "ib.edge.grpc"),  # calls carry tenants' credentials
    ],
)
async def test_subscribe_outside_permissions_is_refused(
    secured, as_role, role: str, subject: str
) -> None:
    conn = await as_role(role)
    await conn.nc.subscribe(subject)
    assert subject.lower() in await conn.violation()


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        ("gateway", "ib.route.fraud"),
        ("gateway", "ib.genroute.llm"),  # generative requests: their own subject
        ("gateway", "ib.infer.fraud.1"),  # direct dispatch of plain routes
        ("gateway", "ib.gen.llm.1"),  # direct dispatch of a generative request
        ("router", "ib.infer.fraud.1"),
        ("worker", "ib.reply.gw-1.7"),
        ("batcher", "ib.reply.gw-1.7"),
        ("registry", "ib.events.registry.fraud"),
        ("gateway", "ib.seq.w-1.acc.1"),  # a request of a sequence, to its worker
        ("gateway", "ib.seqwho.acc.1"),
        ("gateway", "ib.alive.w-1"),  # a liveness probe of a worker (noworker.py)
        ("edge", "ib.edge.grpc"),  # a unary gRPC call, to the gateways' queue group
        ("gateway", "_INBOX_edge.abc.r"),  # a reply frame, to the edge's inbox
    ],
)
async def test_allowed_publish_is_delivered(secured, as_role, role: str, subject: str) -> None:
    conn = await as_role(role)
    admin = await as_role("admin")
    assert await _delivered(admin.nc, subject, lambda: conn.nc.publish(subject, b"ok"))
    assert not conn.errors


async def test_services_connect_with_their_settings(secured, tmp_path: Path) -> None:
    """`ServiceSettings.nats_auth` + `bus.connect`: password file, inbox prefix, KV use."""
    from inferbus_common.catalog import ensure_kv
    from inferbus_common.settings import ServiceSettings

    server, passwords = secured
    pw = tmp_path / "pw"
    pw.write_text(passwords["registry"] + "\n")
    settings = ServiceSettings(nats_url=server.url, nats_user="registry", nats_password_file=pw)
    nc = await connect(settings.nats_url, "test-registry", **settings.nats_auth())
    try:
        kv = await ensure_kv(nc.jetstream(), SUBJECTS.routes_bucket)
        await kv.put("fraud", b"{}")
        assert (await kv.get("fraud")).value == b"{}"
    finally:
        await nc.close()


def test_generate_writes_private_files(tmp_path: Path) -> None:
    passwords = security.generate(tmp_path, SUBJECTS)
    assert set(passwords) == set(security.ROLES)
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"
    env = (tmp_path / "worker.env").read_text()
    assert "INFERBUS_WORKER_NATS_USER=worker" in env
    assert passwords["worker"] not in env  # the password stays in its own file
    assert (tmp_path / "admin.nats-password").read_text() == passwords["admin"]
