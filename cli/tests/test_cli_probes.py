"""The port-in-use check `up` runs before starting anything, and the probes."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferbus_cli.__main__ import main
from inferbus_cli.probes import (
    PortClaim,
    PortInUseError,
    check_ports_free,
    port_in_use,
    read_ports_file,
    redis_ping,
    tcp_open,
)


@pytest.fixture
def listener() -> Iterator[int]:
    """A socket listening on a port the OS picked; yields the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_port_in_use(listener: int) -> None:
    assert port_in_use(listener)
    assert tcp_open(listener)


def test_bound_but_not_listening_is_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert not tcp_open(port)
        assert not redis_ping(f"127.0.0.1:{port}")


def test_check_ports_free_names_the_port_and_flag(listener: int) -> None:
    claims = [
        PortClaim(0, "NATS", "--nats-port"),  # 0 is never checked
        PortClaim(listener, "gateway gRPC", "--grpc-port"),
    ]
    with pytest.raises(PortInUseError) as exc:
        check_ports_free(claims)
    message = str(exc.value)
    assert str(listener) in message
    assert "gateway gRPC" in message
    assert "--grpc-port" in message
    assert exc.value.flag == "--grpc-port"


def test_two_processes_on_one_port_is_refused() -> None:
    with pytest.raises(ValueError, match="--http-port"):
        check_ports_free(
            [PortClaim(18000, "gateway HTTP", "--http-port"), PortClaim(18000, "x", "--grpc-port")]
        )


def test_up_refuses_a_taken_port_before_starting_anything(
    listener: int, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    home = tmp_path / "home"
    rc = main(["up", "--home", str(home), "--free-ports", "--nats-port", str(listener)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"port {listener} (NATS) is already in use" in err
    assert "--nats-port" in err
    assert not (home / "state.json").exists()
    assert not (home / "logs").exists()


def test_read_ports_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    assert read_ports_file(path) is None
    path.write_text('{"pid": 1, "grpc"')  # partial write
    assert read_ports_file(path) is None
    path.write_text(json.dumps({"pid": 1, "grpc": 5}))
    assert read_ports_file(path) == {"pid": 1, "grpc": 5}
