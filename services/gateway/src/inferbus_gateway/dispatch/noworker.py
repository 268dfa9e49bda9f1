"""No live worker: a fast answer that says why, instead of waiting out the deadline.

Before: a request for a version whose only worker had crashed went into the
work queue and waited there for its deadline (DEADLINE_EXCEEDED), for as long
as the dead worker's heartbeat still looked fresh (15 s), until the breaker
opened and answered UNAVAILABLE without saying why.

Now the gateway knows within a fraction of a second, and answers UNAVAILABLE
naming the model, the version, the last worker that served it and how it went:

* **Learning it fast** (`WorkerWatch`): every `interval_s` (0.25 s) the gateway
  sends each worker whose heartbeat names an ``alive_subject`` an empty request
  there. A live worker answers; a dead one cannot, and nats-server, which saw
  its TCP connection close, answers "no responders" at once. Only that answer
  marks a worker gone (`Catalog.mark_gone`); a slow or missing answer (a busy
  worker, a reconnect) changes nothing, so a loaded machine makes no false
  verdicts. A probe still waiting does not hold back the next one: a probe the
  worker took just before it died is never answered, and waiting out its
  timeout (1 s) put the verdict past 1 s after a `kill -9` on a loaded machine;
  at most `MAX_PROBES_PER_WORKER` are in flight per worker (a hung one). A
  worker without the subject (older release) is judged by its heartbeat alone
  (15 s). A gone worker counts again with a newer heartbeat or
  an answered probe.
* **The rule** (`wait_for_worker_s`): a request for a version no live worker
  serves waits only while a worker may come back within its deadline: when the
  version lost its last worker less than ``no_worker_grace_s`` ago and the
  request's deadline lies beyond the end of that grace, it waits (in the
  gateway, for the version to be ready again) until the grace ends; every
  other request is answered at once. The default grace is 0: a crashed worker
  takes seconds to restart and load, longer than most online deadlines, so
  the answer is immediate and says why (retry elsewhere, or the model's
  fallback). The same rule applies to requests already sent to the version
  (waiting for their reply in the dispatcher): those it does not allow to wait
  are answered at once (`WorkerWatch` sweeps them).
* **Lookups**: `Catalog.is_ready` and `Catalog.last_worker` are O(1) (an index
  kept as heartbeats arrive); nothing on the request path does I/O.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client
from prometheus_client import Counter

from inferbus_common.catalog import Catalog, LastWorker
from inferbus_common.errors import Unavailable

log = logging.getLogger(__name__)

WORKERS_GONE = Counter(
    "inferbus_gateway_workers_gone_total",
    "Workers this gateway found gone (a liveness probe got no responders: the "
    "worker's NATS connection closed).",
)
MAX_PROBES_PER_WORKER = 4
"""Probes in flight per worker at most: one per period over the probe timeout."""

SWEPT = Counter(
    "inferbus_gateway_no_worker_swept_total",
    "Requests already sent to a version that lost its last worker, answered "
    "UNAVAILABLE by the gateway instead of at their deadline.",
)

_SWEEP_LATE_S = 5.0
"""A version lost longer ago than the grace plus this is not swept any more (its
requests were answered; new ones are refused before they are sent)."""

FailPending = Callable[[str, str, "int | None", Unavailable], int]
"""Answers the requests sent to (model, version) that wait for a reply, those whose
deadline is before the given ns (None: all), with the error; returns how many."""

_HOW = {
    "gone": "its connection to NATS closed (crashed or killed)",
    "stopped": "it stopped (its record was deleted)",
    "unloaded": "it no longer reports the version ready",
    "stale": "its heartbeat stopped (hung, cut off, or died unseen)",
}


class NoLiveWorker(Unavailable):
    """UNAVAILABLE: no live worker serves the version (it says which, and why).

    Not counted by the model's circuit breaker (the gateway knows the cause; an
    open breaker would hide it and delay recovery by its cool-down); covered by
    the model's fallback like any UNAVAILABLE.
    """


def wait_for_worker_s(
    last: LastWorker | None, *, now_ms: float, timeout_s: float, grace_s: float
) -> float:
    """How long a request for a version no live worker serves may wait for one.

    It waits only while a worker may come back within its deadline: the version
    lost its last worker (`last.lost_ms`) less than `grace_s` ago, and the
    request's `timeout_s` reaches past the end of that grace.

    Returns:
        Seconds to wait (until the grace ends), or 0.0: answer now.
    """
    if last is None or grace_s <= 0:
        return 0.0
    left_s = (last.lost_ms + grace_s * 1000.0 - now_ms) / 1000.0
    if left_s <= 0 or timeout_s <= left_s:
        return 0.0
    return left_s


def last_worker_text(catalog: Catalog, model: str, version: str, now_ms: float) -> str:
    """Who served (`model`, `version`) last and how it went ('' when none did
    since this gateway started)."""
    last = catalog.last_worker(model, version)
    if last is None:
        return ""
    where = f"{last.host}, pid {last.pid}" if last.host else f"pid {last.pid}"
    return (
        f"last served by worker '{last.worker_id}' ({where}): "
        f"{_HOW.get(last.how, last.how)} {max(0.0, now_ms - last.lost_ms) / 1000:.1f} s ago, "
        f"last heartbeat {max(0.0, now_ms - last.heartbeat_ms) / 1000:.1f} s ago"
    )


def no_worker_error(
    catalog: Catalog, model: str, version: str, pool: str, *, now_ms: float | None = None
) -> NoLiveWorker:
    """The answer for a version no live worker serves: what an operator needs at 3 a.m.

    The model and version, the last worker that served it (id, host, pid), how
    and when it stopped, its last heartbeat, how many live workers its pool has,
    and what to do.
    """
    now = time.time() * 1000 if now_ms is None else now_ms
    why = last_worker_text(catalog, model, version, now) or (
        f"no worker of pool '{pool}' has reported it ready since this gateway started"
    )
    live = sum(1 for w in catalog.live_workers() if w.pool == pool)
    return NoLiveWorker(
        f"model '{model}' version '{version}': no worker serves it ({why}); "
        f"pool '{pool}' has {live} live worker{'' if live == 1 else 's'}; "
        f"start or fix a worker of pool '{pool}' (`inferbus status`, the worker logs) "
        "or move the route to a version that is served; nothing was computed, safe to retry"
    )


class WorkerWatch:
    """Probes workers (`Subjects.alive`) and applies the rule to requests already sent.

    Args:
        nc: connected NATS client.
        catalog: the gateway's live catalog (gets `mark_gone`/`mark_alive`).
        fail_pending: answers the requests already sent to a version that are
            waiting for a reply (`Dispatcher.fail_pending`):
            ``(model, version, deadline_before_ns, error) -> count``.
        interval_s: probe period (and how often sent requests are checked).
        grace_s: ``no_worker_grace_s`` (see `wait_for_worker_s`).
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        fail_pending: FailPending | None,
        *,
        interval_s: float = 0.25,
        grace_s: float = 0.0,
    ) -> None:
        self._nc = nc
        self._catalog = catalog
        self._fail_pending = fail_pending
        self._interval_s = interval_s
        self._grace_s = grace_s
        self._probes: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, int] = {}
        """Probes awaiting an answer, by worker."""
        self._task: asyncio.Task[None] | None = None
        self.found_gone = 0
        """Workers found gone so far (tests, logs)."""

    async def __aenter__(self) -> WorkerWatch:
        if self._interval_s > 0:
            self._task = asyncio.create_task(self._run(), name="worker-watch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = [t for t in (self._task, *self._probes) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        self._probes.clear()
        self._in_flight.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.probe()
                self.sweep()
            except Exception:  # never let the watch die
                log.exception("worker watch failed; going on")

    def probe(self) -> None:
        """Send one probe to each worker that takes them, whether or not an earlier
        one is still unanswered (at most `MAX_PROBES_PER_WORKER` in flight)."""
        if not self._nc.is_connected:
            return
        max_age_ms = self._catalog.heartbeat_max_age_s * 1000
        now_ms = time.time() * 1000
        for key, ws in list(self._catalog.workers.items()):
            if not ws.alive_subject or now_ms - ws.ts_ms > max_age_ms:
                continue
            in_flight = self._in_flight.get(key, 0)
            if in_flight >= MAX_PROBES_PER_WORKER:
                continue
            self._in_flight[key] = in_flight + 1
            task = asyncio.create_task(self._probe_one(key, ws.alive_subject))
            self._probes.add(task)
            task.add_done_callback(functools.partial(self._probe_done, key))

    def _probe_done(self, key: str, task: asyncio.Task[None]) -> None:
        self._probes.discard(task)
        left = self._in_flight.get(key, 0) - 1
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)

    async def _probe_one(self, key: str, subject: str) -> None:
        try:
            await self._nc.request(subject, b"", timeout=max(1.0, 4 * self._interval_s))
        except nats.errors.NoRespondersError:
            if self._catalog.mark_gone(key):
                self.found_gone += 1
                WORKERS_GONE.inc()
                ws = self._catalog.workers.get(key)
                log.warning(
                    "worker %s is gone (its NATS connection closed); the versions it served: %s",
                    key,
                    ", ".join(sorted(ws.models)) if ws is not None else "?",
                    extra={"worker_id": key},
                )
                try:
                    self.sweep()  # its requests now, not at the next tick
                except Exception:  # the next tick sweeps again
                    log.exception("sweep failed")
            return
        except (nats.errors.Error, TimeoutError, OSError):
            return  # slow, or a reconnect: no verdict
        if key in self._catalog.gone:
            log.info("worker %s answers again", key, extra={"worker_id": key})
            self._catalog.mark_alive(key)

    def sweep(self, now_ms: float | None = None) -> int:
        """Answer the requests already sent to versions that lost their last worker,
        by the rule (`wait_for_worker_s`): each whose deadline is within the grace
        now, all of them once the grace is over. Returns how many were answered."""
        if self._fail_pending is None:
            return 0
        now = time.time() * 1000 if now_ms is None else now_ms
        # Versions lost within the grace, and for a few seconds after it: a request
        # that passed its readiness check just before the loss may reach the
        # dispatcher a loop turn after a sweep.
        since = now - self._grace_s * 1000 - _SWEEP_LATE_S * 1000
        answered = 0
        for model, version, last in self._catalog.lost_since(since):
            grace_end_ms = last.lost_ms + self._grace_s * 1000
            before_ns: int | None = None  # every waiting request
            if now < grace_end_ms:
                before_ns = int(grace_end_ms * 1e6)  # those due before the grace ends
            dv = self._catalog.versions.get((model, version))
            pool = dv.config.pool if dv is not None else "default"
            answered += self._fail_pending(
                model, version, before_ns, no_worker_error(self._catalog, model, version, pool)
            )
        if answered:
            SWEPT.inc(answered)
        return answered
