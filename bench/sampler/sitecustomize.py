"""A small in-process sampling profiler for benchmark runs (py-spy stand-in).

Put this folder on ``PYTHONPATH`` and set ``INFERBUS_SAMPLE_DIR`` for the
service processes (``bench/profile_stack.py`` does both). A daemon thread
waits for ``$INFERBUS_SAMPLE_DIR/go`` (its text: ``<label> <seconds>``; a new
label starts a new window), then
every ``INFERBUS_SAMPLE_INTERVAL_MS`` (default 5) reads the stacks of all
threads with ``sys._current_frames()`` and keeps a sample only for threads
whose CPU clock moved since the last look: idle threads (a loop parked in
epoll, an executor waiting for work) are left out, as py-spy does by default.
The result is written as ``<label>-<pid>.txt`` in py-spy's ``--format raw`` layout
(``frame;frame;... count``), which ``bench/render.py`` summarises, plus
``<label>-<pid>.json`` with the process's CPU seconds over the window.

Without ``INFERBUS_SAMPLE_DIR`` this module does nothing. The sampler holds the
GIL for a few microseconds per look, about 1 % of a core at 5 ms.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path


def _frame_name(frame) -> str:
    code = frame.f_code
    return f"{code.co_qualname} ({code.co_filename}:{code.co_firstlineno})"


def _stack(frame) -> str:
    names = []
    while frame is not None:
        names.append(_frame_name(frame))
        frame = frame.f_back
    return ";".join(reversed(names))


def _thread_clock(ident: int) -> int | None:
    try:
        return time.pthread_getcpuclockid(ident)
    except (OSError, AttributeError):
        return None


def _sample(out: Path, label: str, seconds: float, interval: float) -> None:
    me = threading.get_ident()
    counts: Counter[str] = Counter()
    last_cpu: dict[int, float] = {}
    clocks: dict[int, int | None] = {}
    t_start = time.monotonic()
    cpu_start = os.times()
    taken = 0
    while time.monotonic() - t_start < seconds:
        time.sleep(interval)
        frames = sys._current_frames()
        for ident, frame in frames.items():
            if ident == me:
                continue
            if ident not in clocks:
                clocks[ident] = _thread_clock(ident)
            clock = clocks[ident]
            busy = True
            if clock is not None:
                try:
                    now = time.clock_gettime(clock)
                except OSError:
                    continue
                busy = now - last_cpu.get(ident, now) > interval * 0.2
                last_cpu[ident] = now
            if busy:
                counts[_stack(frame)] += 1
        taken += 1
    cpu_end = os.times()
    wall = time.monotonic() - t_start
    text = "\n".join(f"{stack} {n}" for stack, n in counts.most_common())
    (out / f"{label}-{os.getpid()}.txt").write_text(text + "\n")
    cpu = (cpu_end.user - cpu_start.user) + (cpu_end.system - cpu_start.system)
    (out / f"{label}-{os.getpid()}.json").write_text(
        json.dumps(
            {"pid": os.getpid(), "wall_s": wall, "cpu_s": cpu, "looks": taken, "argv": sys.argv}
        )
    )


def _code_dirs() -> list[str]:
    """Where the service's inferbus packages were imported from (checks an A/B arm)."""
    return sorted(
        {
            str(Path(m.__file__).parent)
            for name, m in list(sys.modules.items())
            if name.startswith("inferbus_") and "." not in name and getattr(m, "__file__", None)
        }
    )


def _cpu_window(out: Path, label: str, seconds: float) -> None:
    t0, c0 = time.monotonic(), os.times()
    time.sleep(seconds)
    t1, c1 = time.monotonic(), os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    (out / f"{label}-{os.getpid()}.json").write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "wall_s": t1 - t0,
                "cpu_s": cpu,
                "argv": sys.argv,
                "code": _code_dirs(),
            }
        )
    )
    (out / f"{label}-{os.getpid()}.txt").write_text("")


def _watch(out: Path, interval: float, mode: str) -> None:
    go = out / "go"
    done: set[str] = set()
    while True:
        time.sleep(0.05)
        try:
            label, seconds = go.read_text().split()
        except (OSError, ValueError):
            continue
        if label in done:
            continue
        done.add(label)
        if mode == "sample":
            _sample(out, label, float(seconds), interval)
        elif mode == "cpu":
            _cpu_window(out, label, float(seconds))


async def _profile_loop(out: Path) -> None:
    """cProfile the event-loop thread during each window (runs on that loop)."""
    import asyncio
    import cProfile
    import pstats

    go = out / "go"
    done: set[str] = set()
    while True:
        await asyncio.sleep(0.05)
        try:
            label, seconds = go.read_text().split()
        except (OSError, ValueError):
            continue
        if label in done:
            continue
        done.add(label)
        prof = cProfile.Profile()
        t0, c0 = time.monotonic(), os.times()
        prof.enable()
        await asyncio.sleep(float(seconds))
        prof.disable()
        t1, c1 = time.monotonic(), os.times()
        stats = pstats.Stats(prof)
        rows = []
        for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
            rows.append([f"{func} ({'/'.join(Path(file).parts[-2:])}:{line})", nc, tt, ct])
        rows.sort(key=lambda r: r[2], reverse=True)
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        (out / f"{label}-{os.getpid()}.json").write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "wall_s": t1 - t0,
                    "cpu_s": cpu,
                    "argv": sys.argv,
                    "top_tottime": rows[:25],
                    "top_cumtime": sorted(rows, key=lambda r: r[3], reverse=True)[:40],
                }
            )
        )
        (out / f"{label}-{os.getpid()}.txt").write_text("")


def _wrap_runners(out: Path) -> None:
    """Run `_profile_loop` beside the service's main coroutine (asyncio.run / uvloop.run)."""
    import asyncio

    def wrap(run):
        def patched(main, *args, **kwargs):
            async def both():
                task = asyncio.ensure_future(_profile_loop(out))
                try:
                    return await main
                finally:
                    task.cancel()

            return run(both(), *args, **kwargs)

        return patched

    asyncio.run = wrap(asyncio.run)
    try:
        import uvloop
    except ImportError:
        return
    uvloop.run = wrap(uvloop.run)


def _gc_experiment() -> None:
    """``INFERBUS_BENCH_GC=g0,g1,g2`` sets the collector's thresholds (an A/B knob)."""
    value = os.environ.get("INFERBUS_BENCH_GC")
    if value:
        import gc

        gc.set_threshold(*(int(x) for x in value.split(",")))


def _install() -> None:
    _gc_experiment()
    where = os.environ.get("INFERBUS_SAMPLE_DIR")
    if not where:
        return
    mode = os.environ.get("INFERBUS_SAMPLE_MODE", "cpu")
    if mode == "cprofile":
        _wrap_runners(Path(where))
        return
    interval = float(os.environ.get("INFERBUS_SAMPLE_INTERVAL_MS", "5")) / 1000.0
    threading.Thread(
        target=_watch, args=(Path(where), interval, mode), name="inferbus-sampler", daemon=True
    ).start()


_install()
