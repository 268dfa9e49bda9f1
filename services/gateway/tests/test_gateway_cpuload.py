"""CpuLoad: readings of this machine's CPUs and of the loop thread, and the switch."""

from __future__ import annotations

import asyncio
import time

from inferbus_gateway.dispatch import cpuload
from inferbus_gateway.dispatch.cpuload import CpuLoad


async def _ticks(load: CpuLoad, n: int) -> None:
    load.start()
    try:
        await asyncio.sleep(load._interval * (n + 0.5))
    finally:
        load.stop()


async def test_a_busy_loop_reads_as_saturated() -> None:
    load = CpuLoad(interval_s=0.05, alpha=1.0, high=0.5, low=0.4)

    async def spin() -> None:
        # Keep this loop's thread running (short slices, so the timer still fires).
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            t = time.monotonic()
            while time.monotonic() - t < 0.005:
                pass
            await asyncio.sleep(0)

    await asyncio.gather(_ticks(load, 6), spin())
    assert load.loop > 0.5, load.loop
    assert 0.0 <= load.machine <= 1.0
    assert load.saturated


async def test_an_idle_loop_on_an_idle_setting_is_not_saturated() -> None:
    load = CpuLoad(interval_s=0.05, alpha=1.0, high=1.5, low=1.4)  # unreachable
    await _ticks(load, 3)
    assert load.loop < 0.5
    assert not load.saturated


def test_cgroup_quota_and_usage_are_read(tmp_path, monkeypatch) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cpu.stat").write_text("usage_usec 123456\nuser_usec 1\n")
    monkeypatch.setattr(cpuload, "_CGROUP_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(cpuload, "_CGROUP_STAT", tmp_path / "cpu.stat")
    assert cpuload._cgroup_quota() == 1.5
    assert cpuload._cgroup_usage_us() == 123456
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpuload._cgroup_quota() is None


def test_machine_reading_parses_proc_stat(tmp_path, monkeypatch) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    monkeypatch.setattr(cpuload, "_PROC_STAT", stat)
    busy, total = cpuload._machine()
    assert (busy, total) == (150, 1000)
    stat.write_text("garbage\n")
    assert cpuload._machine() is None
