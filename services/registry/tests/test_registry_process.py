"""``python -m inferbus_registry`` as a real process: ports file, readiness, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from inferbus_client.registry import RegistryClient
from inferbus_testing.servers import NatsServer


def _wait_ready(proc: subprocess.Popen[bytes], ports_file: Path, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"registry exited with {proc.returncode}")
        if ports_file.exists():
            ports = json.loads(ports_file.read_text())
            try:
                resp = httpx.get(f"http://127.0.0.1:{ports['metrics']}/readyz", timeout=1)
            except httpx.TransportError:
                resp = None
            if resp is not None and resp.status_code == 200:
                return ports
        time.sleep(0.02)  # polling interval; the condition itself is checked above
    raise AssertionError("registry not ready in time")


async def _push(port: int, src: Path) -> str:
    async with RegistryClient(f"127.0.0.1:{port}") as client:
        return (await client.push(src, "fraud", "1.0.0")).version


@pytest.mark.integration
def test_process_serves_and_stops_on_sigterm(
    registry_nats: NatsServer, tmp_path: Path, make_version: Callable[..., Path]
) -> None:
    ports_file = tmp_path / "ports.json"
    env = {
        **os.environ,
        "INFERBUS_REGISTRY_NATS_URL": registry_nats.url,
        "INFERBUS_REGISTRY_SUBJECT_PREFIX": "proc",
        "INFERBUS_REGISTRY_GRPC_PORT": "0",
        "INFERBUS_REGISTRY_METRICS_PORT": "0",
        "INFERBUS_REGISTRY_STORE_DIR": str(tmp_path / "store"),
        "INFERBUS_REGISTRY_PORTS_FILE": str(ports_file),
        "INFERBUS_REGISTRY_DRAIN_TIMEOUT_S": "2",
    }
    log = (tmp_path / "registry.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferbus_registry"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        ports = _wait_ready(proc, ports_file, timeout=20)
        assert asyncio.run(_push(ports["grpc"], make_version())) == "1.0.0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    lines = [json.loads(line) for line in (tmp_path / "registry.log").read_text().splitlines()]
    assert any(rec.get("msg", "").startswith("registry serving gRPC") for rec in lines)
