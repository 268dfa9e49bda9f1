"""A worker's presence in the workers bucket: its status record, pool admission, heartbeat.

Both workers (the tensor `Worker` and the `LlmWorker`) report the same way:

* a `WorkerStatus` with the versions' states, host and pid, the resources the
  process can use (`HostSpec`: CPUs, memory, GPU type and count) and the time
  it joined, and (tensor workers) each served version's cumulative inference
  statistics (`inferbus_worker.stats`), written every ``interval_s`` and at
  once when something changes;
* pool admission: the pool's quota (``max_workers``/``max_gpus``) admits the
  oldest live members first; a worker over it reports ``admitted: false`` with
  the reason and serves nothing until a place frees up.

`Heartbeat` holds that state and the loop; the workers own the versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from inferbus_common.catalog import Catalog, WorkerStatus
from inferbus_common.modelstats import ModelStats
from inferbus_common.poolquota import pool_admission
from inferbus_common.subjects import subject_token
from inferbus_worker.hostspec import HostSpec
from inferbus_worker.hostspec import detect as detect_spec

log = logging.getLogger(__name__)

VersionKey = tuple[str, str]
"""(model, version)."""

NATS_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, nats.js.errors.Error, OSError)
"""What a lost or slow NATS connection raises (logged and retried, never fatal)."""

MEMBER_MAX_AGE_S = 15.0
"""Heartbeats older than this do not count as pool members for admission."""


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Wait for `event` at most `timeout` seconds.

    Not ``asyncio.wait_for``: on Python 3.11 it can lose a cancellation that
    arrives as the event is set, and an owned loop would then never stop.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


class Heartbeat:
    """One worker's status record, pool admission and heartbeat loop.

    Args:
        instance_id: the worker's id (its key in the workers bucket).
        pool: the pool it serves.
        states: the versions' states now (``(model, version) -> state``).
        interval_s: how often the record is written when nothing changes.
        stats: the served versions' cumulative statistics now (``"model/version"``
            → `ModelStats`; None: the record carries none).

    Attributes:
        spec: what the process can use (`detect` fills it at start).
        joined_unix_ms: start time: pools admit workers oldest first.
        admission: why the pool's quota keeps this worker out ('' = admitted).
        changed: set it to write the record now.
    """

    def __init__(
        self,
        instance_id: str,
        pool: str,
        states: Callable[[], Mapping[VersionKey, str]],
        *,
        interval_s: float,
        stats: Callable[[], dict[str, ModelStats]] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self._stats = stats
        self.pool = pool
        self._states = states
        self._interval_s = interval_s
        self.spec = HostSpec()
        self.joined_unix_ms = time.time_ns() // 1_000_000
        self.admission = ""
        self.changed = asyncio.Event()
        self.alive_subject = ""
        """Where it answers liveness probes (`WorkerStatus.alive_subject`; '' = none yet)."""

    @property
    def key(self) -> str:
        """The record's key in the workers bucket."""
        return subject_token(self.instance_id)

    async def detect(self) -> None:
        """Detect the host spec (in a thread: nvidia-smi may take a moment)."""
        self.spec = await asyncio.to_thread(detect_spec)

    def status(self) -> WorkerStatus:
        """The heartbeat record, as of now."""
        return WorkerStatus(
            worker_id=self.instance_id,
            pool=self.pool,
            models={f"{m}/{v}": s for (m, v), s in self._states().items()},
            ts_ms=int(time.time() * 1000),
            host=socket.gethostname(),
            pid=os.getpid(),
            cpus=self.spec.cpus,
            memory_bytes=self.spec.memory_bytes,
            gpu_type=self.spec.gpu_type,
            gpu_count=self.spec.gpu_count,
            gpu_uuids=list(self.spec.gpu_uuids),
            joined_unix_ms=self.joined_unix_ms,
            admitted=not self.admission,
            reason=self.admission,
            stats=self._stats() if self._stats is not None else {},
            alive_subject=self.alive_subject,
        )

    def update_admission(self, catalog: Catalog) -> bool:
        """Recompute admission from the live heartbeats and the pool's quota.

        Returns:
            Whether it changed (the record is then written at once).
        """
        me = self.status()
        members = [
            w
            for w in catalog.workers.values()
            if w.pool == self.pool and w.worker_id != me.worker_id and w.is_fresh(MEMBER_MAX_AGE_S)
        ]
        reason = pool_admission(self.pool, [*members, me], catalog.pools.get(self.pool)).get(
            me.worker_id, ""
        )
        if reason == self.admission:
            return False
        if reason:
            log.warning("not admitted: %s", reason, extra={"pool": self.pool})
        else:
            log.info("admitted to pool %s", self.pool, extra={"pool": self.pool})
        self.admission = reason
        self.changed.set()
        return True

    async def run(self, kv: KeyValue, closed: Callable[[], bool]) -> None:
        """Write the record every ``interval_s`` and whenever `changed` is set, until `closed`."""
        while not closed():
            self.changed.clear()
            try:
                await kv.put(self.key, self.status().model_dump_json().encode())
            except NATS_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
            await wait_event(self.changed, self._interval_s)

    async def remove(self, kv: KeyValue) -> None:
        """Delete the record (leaving: the pool's place frees at once)."""
        with contextlib.suppress(*NATS_ERRORS):
            await kv.delete(self.key)
