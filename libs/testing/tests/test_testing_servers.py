"""Smoke tests of the real test servers: start, connect, kill, restart."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
import redis
from minio import Minio
from minio.error import S3Error

from inferbus_testing.servers import NatsServer, RedisServer, S3Server, ServerError

pytestmark = pytest.mark.integration


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_nats_server_serves_jetstream(nats_server: NatsServer) -> None:
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SMOKE", subjects=["smoke.>"])
        ack = await js.publish("smoke.a", b"hello")
        assert ack.stream == "SMOKE"
        assert ack.seq == 1
    finally:
        await nc.close()


async def test_nats_server_restart_keeps_port_and_jetstream_data(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name="KEEP", subjects=["keep.>"])  # file storage by default
    await js.publish("keep.x", b"survives")
    await nc.close()

    port, pid = nats_server.port, nats_server.pid
    assert pid is not None
    nats_server.kill()
    assert not nats_server.running
    assert not _pid_alive(pid)
    nats_server.restart()
    assert nats_server.port == port
    assert nats_server.pid != pid

    nc = await nats.connect(nats_server.url)
    try:
        msg = await nc.jetstream().get_msg("KEEP", 1)
        assert msg.data == b"survives"
    finally:
        await nc.close()


async def test_nats_client_reconnects_across_restart(nats_server: NatsServer) -> None:
    reconnected = False

    async def on_reconnect() -> None:
        nonlocal reconnected
        reconnected = True

    nc = await nats.connect(
        nats_server.url, reconnected_cb=on_reconnect, reconnect_time_wait=0.05,
        max_reconnect_attempts=-1,
    )  # fmt: skip
    try:
        await nats_server.arestart()
        sub = await nc.subscribe("ping")
        await nc.flush(timeout=5)
        await nc.publish("ping", b"1")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"1"
        assert reconnected
    finally:
        await nc.close()


async def test_nats_client_fixture(nats_client: nats.NATS) -> None:
    sub = await nats_client.subscribe("x")
    await nats_client.publish("x", b"y")
    assert (await sub.next_msg(timeout=2)).data == b"y"


def test_nats_server_close_removes_everything() -> None:
    server = NatsServer()
    with server:
        pid = server.pid
        assert pid is not None and _pid_alive(pid)
        assert server.dir.exists()
    assert not _pid_alive(pid)
    assert not server.dir.exists()


def test_nats_server_url_before_start_is_an_error() -> None:
    server = NatsServer()
    try:
        with pytest.raises(ServerError, match="not started"):
            _ = server.url
    finally:
        server.close()


def test_nats_server_start_failure_shows_log(tmp_path: Path) -> None:
    server = NatsServer(tmp_path, extra_args=["--no-such-flag"])
    with pytest.raises(ServerError, match=r"(?s)exited with code .*--- log tail"):
        server.start()


def test_redis_server_set_get_restart(redis_server: RedisServer) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
        port = redis_server.port
        redis_server.kill()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        redis_server.restart()
        assert redis_server.port == port
        # No persistence: a restarted redis is empty.
        assert client.get("k") is None
    finally:
        client.close()


def test_redis_server_retries_when_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferbus_testing.servers import stores

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    ports = [taken]

    def next_port(span: int = 1) -> int:
        return ports.pop(0) if ports else original(span)

    original = stores._random_port
    monkeypatch.setattr(stores, "_random_port", next_port)
    try:
        with RedisServer() as server:
            assert server.port != taken
            assert redis.Redis.from_url(server.url).ping()
    finally:
        held.close()


def test_s3_server_put_get_and_signature_check(s3_server: S3Server, s3_bucket: str) -> None:
    client = Minio(
        s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        secure=False,
    )
    client.put_object(s3_bucket, "a/b.bin", io.BytesIO(b"\x00\x01data"), 6)
    assert client.get_object(s3_bucket, "a/b.bin").read() == b"\x00\x01data"
    assert s3_bucket in {b.name for b in client.list_buckets()}

    wrong = Minio(
        s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key + "x",
        secure=False,
    )
    with pytest.raises(S3Error) as info:
        wrong.list_buckets()
    assert info.value.code == "SignatureDoesNotMatch"

    anonymous = Minio(s3_server.endpoint, secure=False)
    with pytest.raises(S3Error) as info:
        anonymous.get_object(s3_bucket, "a/b.bin")
    assert info.value.code == "AccessDenied"


def test_s3_buckets_are_unique_per_test(s3_server: S3Server, s3_bucket: str) -> None:
    client = s3_server.client()
    assert list(client.list_objects(s3_bucket)) == []


def test_servers_die_with_a_killed_test_process(tmp_path: Path) -> None:
    # A test run killed by SIGKILL runs no `finally`; the server must not outlive it.
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from inferbus_testing.servers import NatsServer\n"
        "s = NatsServer(Path(sys.argv[1])).start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    argv = [sys.executable, "-c", script, str(tmp_path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            server_pid = int(parent.stdout.readline())
            assert _pid_alive(server_pid)
        finally:
            parent.kill()
    deadline = time.monotonic() + 5
    while _pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pid_alive(server_pid)
