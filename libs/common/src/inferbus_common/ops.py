"""The operations endpoints every service exposes: /metrics, /healthz, /readyz.

Also the small helpers to run a Starlette app on an already-bound socket (so a
service can bind port 0 and report the port it got) and to write the ports file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """Bind a listening TCP socket (port 0 = the OS picks); read the port back.

    With `reuse_port` the socket is bound with SO_REUSEPORT: other processes
    (of the same user) bound the same way share the port, the kernel spreading
    new connections over them.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class PortTakenError(OSError):
    """A port a process group was to share is held by a process outside it."""


def check_port_free(host: str, port: int, role: str) -> None:
    """Fail unless `host:port` can be bound *without* SO_REUSEPORT (port 0: nothing to check).

    A process group that shares ports with SO_REUSEPORT would otherwise join
    any listener of the same user bound that way, silently. The first process
    of a group calls this before binding; a listener started between this check
    and its own bind (a window of milliseconds) is not caught.

    Raises:
        PortTakenError: something listens on (or holds) the port.
    """
    if port == 0:
        return
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        raise PortTakenError(
            exc.errno, f"{role} port {host}:{port} is already in use ({exc.strerror})"
        ) from exc
    finally:
        probe.close()


def ops_app(ready: Callable[[], tuple[bool, str]], extra_routes: Sequence[Route] = ()) -> Starlette:
    """Starlette app with /metrics, /healthz (process alive) and /readyz.

    Args:
        ready: returns (is_ready, reason); /readyz answers 503 with the reason
            until the service can really serve.
        extra_routes: further routes (the gateway's ``/metrics/group``).
    """

    async def metrics(_: Request) -> Response:
        return Response(
            prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    async def healthz(_: Request) -> Response:
        return JSONResponse({"live": True})

    async def readyz(_: Request) -> Response:
        ok, reason = ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            *extra_routes,
        ]
    )


class _Server(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM/SIGINT to the service.

    The service drains on its own stop event (`lifecycle.stop_event_on_signals`)
    and stops its HTTP servers last; uvicorn's own handlers would stop them at
    the signal, before the drain.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_http(
    app: Callable[..., Any],
    sock: socket.socket,
    *,
    tls_cert_file: Path | None = None,
    tls_key_file: Path | None = None,
    tls_client_ca_file: Path | None = None,
    streams: bool = False,
) -> AsyncIterator[uvicorn.Server]:
    """Serve an ASGI app on a bound socket for the duration of the context.

    With a certificate and key it serves HTTPS; with a client CA too, clients
    must present a certificate signed by it (mutual TLS). `streams`: the app
    streams responses (server-sent events); get their machinery ready first.
    """
    tls = tls_cert_file is not None and tls_key_file is not None
    mutual = tls and tls_client_ca_file is not None
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        loop="none",
        http="httptools",
        ssl_certfile=str(tls_cert_file) if tls else None,
        ssl_keyfile=str(tls_key_file) if tls else None,
        ssl_ca_certs=str(tls_client_ca_file) if mutual else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE,
    )
    if streams:
        # Starlette runs a streamed response in an anyio task group, and anyio
        # imports its asyncio backend on first use: ~90 ms that the first
        # streamed answer after a start paid. Paid here, before serving.
        async with anyio.create_task_group():
            pass
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
                raise RuntimeError("HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        yield server
    finally:
        server.should_exit = True
        await task


def write_ports_file(path: Path | None, ports: dict[str, int]) -> None:
    """Atomically write ``{"pid": ..., name: port}`` as JSON (no-op when `path` is None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **ports}))
    tmp.replace(path)
