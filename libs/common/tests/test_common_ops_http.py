"""`ops.serve_http`: a server whose app streams gets anyio's backend ready before serving.

Starlette runs a streamed response in an anyio task group, and anyio imports
its asyncio backend on the first one (about 90 ms): without the warm-up the
first server-sent-events answer after a gateway start paid it. Each case runs
in a fresh interpreter, where nothing has imported the backend yet.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import asyncio, sys
from starlette.responses import PlainTextResponse
from inferbus_common import ops

async def app(scope, receive, send):
    await PlainTextResponse("ok")(scope, receive, send)

async def main():
    sock = ops.bind_socket("127.0.0.1", 0)
    async with ops.serve_http(app, sock, streams={streams}):
        print("anyio._backends._asyncio" in sys.modules)

asyncio.run(main())
"""


@pytest.mark.parametrize("streams", [True, False])
def test_a_streaming_server_imports_anyio_s_backend_before_it_serves(streams: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(streams=streams)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(streams)
