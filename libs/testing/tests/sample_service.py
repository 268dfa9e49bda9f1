"""A minimal real service for the `ServiceProcess` tests (run as ``python -m sample_service``).

It behaves like an inferbus service: binds its metrics port on port 0, serves
/healthz and /readyz, writes ``SAMPLE_SERVICE_PORTS_FILE``, and exits cleanly on
SIGTERM. ``SAMPLE_SERVICE_MODE`` selects misbehaviour for the error-path tests:
``crash`` (exit 3 before writing ports), ``hang`` (never write ports),
``stubborn`` (ignore SIGTERM), ``unready`` (/readyz stays 503).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from inferbus_common.lifecycle import run, stop_event_on_signals
from inferbus_common.ops import bind_socket, ops_app, serve_http, write_ports_file


async def main() -> None:
    """Serve until SIGTERM (or misbehave as ``SAMPLE_SERVICE_MODE`` asks)."""
    mode = os.environ.get("SAMPLE_SERVICE_MODE", "")
    print(f"sample service starting, mode={mode!r}", flush=True)
    if mode == "crash":
        print("sample service: crashing on purpose", file=sys.stderr, flush=True)
        raise SystemExit(3)
    stop = stop_event_on_signals()
    if mode == "stubborn":
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "hang":
        await stop.wait()
        return
    sock = bind_socket("127.0.0.1", 0)
    app = ops_app(lambda: (mode != "unready", "not ready on purpose" if mode else "ok"))
    async with serve_http(app, sock):
        ports_file = os.environ.get("SAMPLE_SERVICE_PORTS_FILE")
        port = sock.getsockname()[1]
        write_ports_file(Path(ports_file) if ports_file else None, {"metrics": port})
        await stop.wait()
    print("sample service stopped", flush=True)


if __name__ == "__main__":
    run(main, use_uvloop=False)
