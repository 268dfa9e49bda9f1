"""How late the LLM worker's event loop runs, and what the garbage collector costs it.

Every chunk of every stream leaves through this process's one event loop (vLLM's
output handler, the NATS client, the per-request tasks): any time the loop
spends elsewhere holds every stream's next chunk back, and the chunks come out
in a burst afterwards. Two numbers make that visible:

- ``inferbus_llm_event_loop_lag_seconds``: how much later than asked a short
  sleep wakes up (`watch_loop`), sampled all the time;
- ``inferbus_llm_gc_pause_seconds{generation}``: each cyclic collection's
  duration (`GcPauses`); with torch, transformers and vLLM loaded a full
  (generation 2) collection walks millions of objects.

Measured with ``bench/llm_chunks.py`` (10 streams of 64 tokens, one at a time,
the two-layer tiny model on the 2-core CI machine): about 1 % of the 20 ms
samples woke more than 20 ms late and no collection ran while streaming, so the
bursts that run showed were not the worker's loop (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from prometheus_client import Histogram

log = logging.getLogger(__name__)

_PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

LOOP_LAG = Histogram(
    "inferbus_llm_event_loop_lag_seconds",
    "How much later than asked a short sleep in the LLM worker's event loop woke up "
    "(every chunk of every stream waits that long).",
    buckets=_PAUSE_BUCKETS,
)
GC_PAUSE = Histogram(
    "inferbus_llm_gc_pause_seconds",
    "Duration of each cyclic garbage collection in the LLM worker, by generation.",
    ["generation"],
    buckets=_PAUSE_BUCKETS,
)


async def watch_loop(interval_s: float = 0.02) -> None:
    """Sample the loop's lag into `LOOP_LAG` until cancelled."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(interval_s)
        LOOP_LAG.observe(max(0.0, time.monotonic() - t0 - interval_s))


class GcPauses:
    """Times every cyclic collection into `GC_PAUSE` while installed (a context manager)."""

    def __init__(self) -> None:
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            GC_PAUSE.labels(str(info.get("generation", "?"))).observe(
                time.perf_counter() - self._started
            )
            self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
