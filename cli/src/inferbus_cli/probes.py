"""Checks on the network side of a local stack: ports in use, readiness probes.

All of them target 127.0.0.1 only and use short timeouts; callers poll them
until a monotonic deadline.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


class PortInUseError(Exception):
    """A fixed port `up` needs is already taken.

    Args:
        port: the port number.
        role: what would have used it (``NATS``, ``gateway HTTP`` ...).
        flag: the ``inferbus up`` option that changes it.
    """

    def __init__(self, port: int, role: str, flag: str) -> None:
        super().__init__(
            f"port {port} ({role}) is already in use on {LOOPBACK}; "
            f"stop what uses it or choose another port with {flag} PORT (0 = any free port)"
        )
        self.port = port
        self.role = role
        self.flag = flag


@dataclass(frozen=True, slots=True)
class PortClaim:
    """A port a process of the stack will bind.

    Attributes:
        port: the number (0 = the OS picks, never checked).
        role: what binds it, for messages.
        flag: the option that sets it.
    """

    port: int
    role: str
    flag: str


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """Whether something listens on (or holds) `host:port`.

    Binds with SO_REUSEADDR like the servers do, so a port left in TIME_WAIT
    counts as free (the servers can bind it) while a listener counts as taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def check_ports_free(claims: list[PortClaim], host: str = LOOPBACK) -> None:
    """Check every fixed port before anything is started.

    Raises:
        PortInUseError: for the first port that is taken.
        ValueError: if two processes would bind the same fixed port.
    """
    seen: dict[int, PortClaim] = {}
    for claim in claims:
        if claim.port == 0:
            continue
        other = seen.get(claim.port)
        if other is not None:
            raise ValueError(
                f"port {claim.port} is given to both {other.role} ({other.flag}) "
                f"and {claim.role} ({claim.flag})"
            )
        seen[claim.port] = claim
    for claim in seen.values():
        if port_in_use(claim.port, host):
            raise PortInUseError(claim.port, claim.role, claim.flag)


def read_ports_file(path: Path) -> dict[str, Any] | None:
    """The JSON a service wrote to its ports file, or None while it is absent or partial."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def http_status(port: int, path: str, host: str = LOOPBACK, timeout: float = 1.0) -> int | None:
    """HTTP status of ``GET http://host:port/path``, or None if nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def http_json(port: int, path: str, host: str = LOOPBACK, timeout: float = 1.0) -> Any:
    """``GET`` a JSON document; None if nothing answers or the body is not JSON."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        body = conn.getresponse().read()
        return json.loads(body)
    except (OSError, http.client.HTTPException, json.JSONDecodeError):
        return None
    finally:
        conn.close()


def redis_ping(address: str, timeout: float = 1.0) -> bool:
    """Whether a Redis server answers PING (``HOST:PORT`` or a unix socket path)."""
    family = socket.AF_UNIX if address.startswith("/") else socket.AF_INET
    target: Any = address
    if family == socket.AF_INET:
        host, _, port = address.rpartition(":")
        target = (host, int(port))
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(target)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def tcp_open(port: int, host: str = LOOPBACK, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to `host:port` succeeds."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False
