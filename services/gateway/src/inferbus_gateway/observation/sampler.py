"""`SampledQueue`: what payload capture and the drift monitor share.

Both watch answered requests from the request path and do their work later:
`observe` (on the request path) only decides, with a random draw against a
sample rate, and queues references to tensors the request already holds; a
background task owned by the context manager does the rest. The queue is
bounded: a full queue drops the sample and counts it, it never blocks a
request. Leaving the context stops the task: bounded, since a stuck NATS
connection must not hold up the gateway's shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections.abc import Callable
from types import TracebackType
from typing import Generic, Self, TypeVar

from prometheus_client import Counter

T = TypeVar("T")

STOP_TIMEOUT_S = 5.0
"""How long leaving waits for the background task before cancelling it."""


class SampledQueue(Generic[T]):
    """A sample rate, a bounded queue of samples and the task that consumes them.

    Subclasses implement `_run` (the background task: it returns once `_stop`
    is set) and call `_sampled` and `_enqueue` from their `observe`.

    Args:
        rate: fraction (0-1) of answered requests sampled; 0 disables.
        queue_size: samples waiting for the background task at most.
        draw: random source in [0, 1) (injectable for tests).
        counter: counts dropped samples as ``(model, "queue-full")``.
        task_name: name of the background task.
    """

    def __init__(
        self,
        *,
        rate: float,
        queue_size: int,
        draw: Callable[[], float] = random.random,
        counter: Counter,
        task_name: str,
    ) -> None:
        self._rate = rate
        self._queue: collections.deque[T] = collections.deque()
        self._queue_size = queue_size
        self._draw = draw
        self._counter = counter
        self._task_name = task_name
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        """Whether any request can be sampled."""
        return self._rate > 0

    def _sampled(self) -> bool:
        """The random draw against the rate (always True at rate 1)."""
        return self._rate >= 1.0 or self._draw() < self._rate

    def _enqueue(self, model: str, item: T) -> None:
        """Queue a sample and wake the task; a full queue drops it (counted)."""
        if len(self._queue) >= self._queue_size:
            self._counter.labels(model, "queue-full").inc()
            return
        self._queue.append(item)
        self._wake.set()

    async def _run(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        if self.enabled:
            self._task = asyncio.create_task(self._run(), name=self._task_name)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._wake.set()
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=STOP_TIMEOUT_S)
            if not done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
