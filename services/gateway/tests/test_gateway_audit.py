"""Audit records are published in batches (`AuditBatches`), against a real nats-server."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.aio.client import Client
from prometheus_client import REGISTRY

from inferbus_common import bus
from inferbus_common.audit import decode_records, split_records
from inferbus_common.subjects import Subjects
from inferbus_gateway.observation.auditbatch import AuditBatches
from inferbus_testing.records import audit_record

SUBJECTS = Subjects("ib")


def _record(model: str, rid: str) -> bytes:
    return audit_record(
        model, request_id=rid, ts_unix_ms=time.time_ns() // 1_000_000, stages_ms={"queue": 0.5}
    )


def _counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def _listen(nc: Client) -> asyncio.Queue[tuple[str, list[str]]]:
    """Every audit message as (subject, request ids of its records, in order)."""
    got: asyncio.Queue[tuple[str, list[str]]] = asyncio.Queue()

    async def on_msg(msg) -> None:
        await got.put((msg.subject, [r.request_id for r in decode_records(msg.data)]))

    await nc.subscribe(SUBJECTS.audit_records_all, cb=on_msg)
    await bus.sync(nc)
    return got


async def _next(got: asyncio.Queue, timeout: float = 2.0) -> tuple[str, list[str]]:
    return await asyncio.wait_for(got.get(), timeout)


async def test_records_of_a_model_go_out_together_after_the_delay(nats_client: Client) -> None:
    got = await _listen(nats_client)
    batches = AuditBatches(nats_client, SUBJECTS, max_delay_s=0.05)
    messages = _counter("inferbus_gateway_audit_messages_total")
    t0 = time.monotonic()
    for i in range(5):
        batches.add("fraud", _record("fraud", f"f{i}"))
    batches.add("heavy", _record("heavy", "h0"))
    first = [await _next(got), await _next(got)]
    waited = time.monotonic() - t0
    assert sorted(first) == [
        (SUBJECTS.audit("fraud"), ["f0", "f1", "f2", "f3", "f4"]),
        (SUBJECTS.audit("heavy"), ["h0"]),
    ]
    assert 0.04 <= waited < 1.5, waited
    assert _counter("inferbus_gateway_audit_messages_total") - messages == 2
    # The next record starts a new batch (and a new timer).
    batches.add("fraud", _record("fraud", "f5"))
    assert await _next(got) == (SUBJECTS.audit("fraud"), ["f5"])
    await batches.close()
    assert got.empty()


async def test_a_full_batch_goes_at_once(nats_client: Client) -> None:
    got = await _listen(nats_client)
    batches = AuditBatches(nats_client, SUBJECTS, max_delay_s=60.0, max_records=3)
    for i in range(7):
        batches.add("fraud", _record("fraud", f"r{i}"))
    assert (await _next(got))[1] == ["r0", "r1", "r2"]
    assert (await _next(got))[1] == ["r3", "r4", "r5"]
    assert got.empty()
    # A byte bound too: two records over 300 bytes go as soon as they pass it.
    by_size = AuditBatches(nats_client, SUBJECTS, max_delay_s=60.0, max_bytes=300)
    by_size.add("heavy", _record("heavy", "s0"))
    by_size.add("heavy", _record("heavy", "s1"))
    assert await _next(got) == (SUBJECTS.audit("heavy"), ["s0", "s1"])
    # What waits when the gateway drains is sent, not lost.
    await batches.close()
    assert (await _next(got))[1] == ["r6"]
    # After close each record goes alone, at once.
    batches.add("fraud", _record("fraud", "late"))
    assert (await _next(got))[1] == ["late"]
    await by_size.close()


async def test_no_delay_sends_every_record_alone(nats_client: Client) -> None:
    got = await _listen(nats_client)
    batches = AuditBatches(nats_client, SUBJECTS, max_delay_s=0.0)
    for i in range(3):
        batches.add("fraud", _record("fraud", f"r{i}"))
    assert [await _next(got) for _ in range(3)] == [
        (SUBJECTS.audit("fraud"), [f"r{i}"]) for i in range(3)
    ]


async def test_a_failed_publish_counts_every_record_and_raises_nothing(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    batches = AuditBatches(nc, SUBJECTS, max_delay_s=60.0)
    batches.add("fraud", _record("fraud", "a"))
    batches.add("fraud", _record("fraud", "b"))
    await nc.close()
    dropped = _counter("inferbus_gateway_audit_dropped_total")
    await batches.close()
    assert _counter("inferbus_gateway_audit_dropped_total") - dropped == 2


def test_split_records_reads_single_and_batched_messages() -> None:
    one = _record("m", "x")
    assert list(split_records(one)) == [one]
    assert list(split_records(b"")) == []
    assert list(split_records(one + b"\n\n" + one + b"\n")) == [one, one]
