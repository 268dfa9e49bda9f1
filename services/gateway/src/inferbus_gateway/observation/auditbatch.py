"""Audit records published a batch at a time, one message per model every few ms.

One audit message per answered request cost every process on its way: a
publish (and usually a socket write) in the gateway, a JetStream store in
nats-server (the audit stream keeps files), and one message for each router
and the rollout controller to parse. Measured at concurrency 64 on the fraud
model, turning audit off saved 0.12 of the platform's CPU per request
(`bench/findings.md`, round 6). So records of one model are collected for up
to ``max_delay_s`` (or ``max_records`` / ``max_bytes``, whichever comes first)
and sent as one message whose body is the records one per line
(`inferbus_common.audit.split_records` takes them apart; a single record is
exactly the JSON object it always was).

Publishing stays fire-and-forget: a failure is counted in
``inferbus_gateway_audit_dropped_total`` (per record) and never reaches a
request. `close` sends what is collected, so a gateway that drains loses no
record; a crash loses at most ``max_delay_s`` of them.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from prometheus_client import Counter

from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

AUDIT_DROPPED = Counter(
    "inferbus_gateway_audit_dropped_total",
    "Audit records that could not be published (the requests were answered regardless).",
)
AUDIT_MESSAGES = Counter(
    "inferbus_gateway_audit_messages_total",
    "Audit messages published; each carries one or more records (one per line).",
)

_SEPARATOR = b"\n"


class _Pending:
    """Records of one model waiting to be sent, and the timer that sends them."""

    __slots__ = ("bytes", "records", "timer")

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.bytes = 0
        self.timer: asyncio.TimerHandle | None = None


class AuditBatches:
    """Collects the gateway's audit records and publishes them per model in batches.

    Args:
        nc: connected NATS client.
        subjects: naming scheme (``<prefix>.audit.<model>``).
        max_delay_s: longest a record waits before it is sent; 0 sends each
            record as its own message at once (the pre-batching behaviour).
        max_records: a batch with this many records is sent at once.
        max_bytes: a batch whose records reach this size is sent at once
            (kept well under the server's ``max_payload``).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        max_delay_s: float,
        max_records: int = 512,
        max_bytes: int = 256 * 1024,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self.max_delay_s = max_delay_s
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._pending: dict[str, _Pending] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self._closed = False

    def add(self, model: str, record: bytes) -> None:
        """Queue one encoded record (`inferbus_common.audit.encode_record`); never raises.

        No coroutine of its own (every request's path): a batch that is due is
        sent by a task of its own (`close` waits for those).
        """
        if self.max_delay_s <= 0 or self._closed:
            self._spawn(model, [record])
            return
        pending = self._pending.get(model)
        if pending is None:
            pending = self._pending[model] = _Pending()
        pending.records.append(record)
        pending.bytes += len(record) + 1
        if len(pending.records) >= self._max_records or pending.bytes >= self._max_bytes:
            self._spawn(model, self._take(model))
        elif pending.timer is None:
            pending.timer = asyncio.get_running_loop().call_later(
                self.max_delay_s, self._on_timer, model
            )

    def _take(self, model: str) -> list[bytes]:
        pending = self._pending.pop(model)
        if pending.timer is not None:
            pending.timer.cancel()
        return pending.records

    def _on_timer(self, model: str) -> None:
        pending = self._pending.get(model)
        if pending is None:
            return
        pending.timer = None
        self._spawn(model, self._take(model))

    def _spawn(self, model: str, records: list[bytes]) -> None:
        task = asyncio.create_task(self._send(model, records))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, model: str, records: list[bytes]) -> None:
        try:
            await self._nc.publish(self._subjects.audit(model), _SEPARATOR.join(records))
        except Exception as exc:  # the audit trail must never fail a request
            AUDIT_DROPPED.inc(len(records))
            log.debug("%d audit records dropped: %s", len(records), type(exc).__name__)
            return
        AUDIT_MESSAGES.inc()

    async def close(self) -> None:
        """Send every collected record now; later records are sent one by one."""
        self._closed = True
        for model in list(self._pending):
            await self._send(model, self._take(model))
        if self._sending:
            # Waits for the timers' sends in flight (`_send` counts its own failures).
            await asyncio.gather(*self._sending, return_exceptions=True)
