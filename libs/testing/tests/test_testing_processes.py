"""Tests of `ServiceProcess` and the ``spawn_service`` fixture with a real sample service."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from inferbus_testing.fixtures import SpawnService
from inferbus_testing.processes import ServiceError, ServiceProcess

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def _env(mode: str = "") -> dict[str, str]:
    # sample_service.py lives next to this file; make it importable for `python -m`.
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "SAMPLE_SERVICE_MODE": mode}


async def test_async_start_ready_and_terminate(tmp_path: Path) -> None:
    async with ServiceProcess("sample_service", env=_env(), log_dir=tmp_path) as proc:
        assert proc.env_prefix == "SAMPLE_SERVICE_"
        assert set(proc.ports) == {"metrics"}
        await proc.await_ready()
        async with httpx.AsyncClient() as client:
            assert (await client.get(proc.readyz_url())).json() == {"ready": True, "reason": "ok"}
        pid = proc.pid
        assert pid is not None
        code = await proc.aterminate()
        assert code == 0, proc.log_tail()
    assert "sample service stopped" in (tmp_path / "sample_service.log").read_text()


def test_sync_start_ready_and_terminate(tmp_path: Path) -> None:
    with ServiceProcess("sample_service", env=_env(), log_dir=tmp_path) as proc:
        proc.wait_ready()
        assert proc.terminate() == 0
        assert not proc.running


async def test_crash_during_start_raises_with_log_tail() -> None:
    proc = ServiceProcess("sample_service", env=_env("crash"))
    with pytest.raises(ServiceError, match=r"(?s)exited with code 3.*crashing on purpose"):
        await proc.astart(timeout=20)
    proc.cleanup()


async def test_start_timeout_kills_the_process() -> None:
    proc = ServiceProcess("sample_service", env=_env("hang"))
    try:
        with pytest.raises(ServiceError, match="no ports file"):
            await proc.astart(timeout=0.5)
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.cleanup()


async def test_terminate_escalates_to_sigkill(tmp_path: Path) -> None:
    proc = await ServiceProcess("sample_service", env=_env("stubborn"), log_dir=tmp_path).astart()
    try:
        assert await proc.aterminate(timeout=0.3) == -signal.SIGKILL
    finally:
        proc.cleanup()


async def test_not_ready_times_out_with_reason(tmp_path: Path) -> None:
    async with ServiceProcess("sample_service", env=_env("unready"), log_dir=tmp_path) as proc:
        with pytest.raises(ServiceError, match="not 200 after"):
            await proc.await_ready(timeout=0.3)


async def test_ready_wait_notices_a_crash(tmp_path: Path) -> None:
    async with ServiceProcess("sample_service", env=_env("unready"), log_dir=tmp_path) as proc:
        proc.kill()
        with pytest.raises(ServiceError, match="exited with code -9 before being ready"):
            await proc.await_ready(timeout=5)


def test_ports_before_start_is_an_error() -> None:
    proc = ServiceProcess("sample_service")
    try:
        with pytest.raises(ServiceError, match="ports not known yet"):
            _ = proc.ports
    finally:
        proc.cleanup()


async def test_spawn_service_fixture_stops_processes(spawn_service: SpawnService) -> None:
    first = await spawn_service("sample_service", env=_env(), env_prefix="SAMPLE_SERVICE_")
    second = await spawn_service("sample_service", env=_env(), name="second")
    assert first.ports["metrics"] != second.ports["metrics"]
    await second.await_ready()
    # Teardown of the fixture terminates both; nothing to do here.
