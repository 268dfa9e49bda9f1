"""`PullConsumer`: JetStream's pull protocol over public nats-py calls (real nats-server).

These pin the protocol behaviour the worker relies on, for the nats-py and
nats-server versions in the lock: a long poll returns at the first message,
an expired one returns nothing, a no-wait pull returns what waits and ends,
and a consumer or stream that is gone raises `ConsumerGone`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from inferbus_worker.pull import ConsumerGone, PullConsumer

pytestmark = pytest.mark.integration

_names = itertools.count()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()


async def _stream(nc: Client) -> tuple[str, str, str]:
    """A work-queue stream and a durable explicit-ack consumer on it."""
    n = next(_names)
    stream, subject, consumer = f"PULL{n}", f"pull{n}.work", f"c{n}"
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=stream,
            subjects=[subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.MEMORY,
        )
    )
    await js.add_consumer(
        stream,
        ConsumerConfig(durable_name=consumer, ack_policy=AckPolicy.EXPLICIT, ack_wait=30),
    )
    return stream, subject, consumer


async def test_long_poll_returns_at_the_first_message(nc: Client) -> None:
    stream, subject, consumer = await _stream(nc)
    puller = PullConsumer(nc, stream, consumer)
    await puller.start()
    try:
        fetch = asyncio.ensure_future(puller.fetch(1, 10.0))
        await asyncio.sleep(0.1)
        assert not fetch.done()
        t0 = time.monotonic()
        await nc.jetstream().publish(subject, b"one")
        (msg,) = await asyncio.wait_for(fetch, 5)
        assert time.monotonic() - t0 < 5  # the message, not the 10 s expiry
        assert msg.data == b"one"
        assert msg.metadata.num_delivered == 1
        await msg.ack()
    finally:
        await puller.stop()


async def test_an_expired_long_poll_returns_nothing(nc: Client) -> None:
    stream, _, consumer = await _stream(nc)
    puller = PullConsumer(nc, stream, consumer)
    await puller.start()
    try:
        assert await asyncio.wait_for(puller.fetch(1, 0.2), 5) == []
    finally:
        await puller.stop()


async def test_no_wait_takes_what_waits_and_ends(nc: Client) -> None:
    stream, subject, consumer = await _stream(nc)
    js = nc.jetstream()
    for i in range(3):
        await js.publish(subject, f"m{i}".encode())
    puller = PullConsumer(nc, stream, consumer)
    await puller.start()
    try:
        got = await asyncio.wait_for(puller.fetch(10, 5.0, no_wait=True), 5)
        assert [m.data for m in got] == [b"m0", b"m1", b"m2"]
        assert got[0].metadata.num_pending == 2
        for m in got:
            await m.ack()
        assert await asyncio.wait_for(puller.fetch(10, 5.0, no_wait=True), 2) == []
        # Nothing lingers on the server: a message published now stays for the next pull.
        await js.publish(subject, b"later")
        await asyncio.sleep(0.1)
        info = await js.consumer_info(stream, consumer)
        assert (info.num_pending, info.num_ack_pending) == (1, 0)
    finally:
        await puller.stop()


async def test_a_deleted_consumer_is_reported(nc: Client) -> None:
    stream, _, consumer = await _stream(nc)
    puller = PullConsumer(nc, stream, consumer)
    await puller.start()
    try:
        pending = asyncio.ensure_future(puller.fetch(1, 10.0))
        await asyncio.sleep(0.1)
        await nc.jetstream().delete_consumer(stream, consumer)
        with pytest.raises(ConsumerGone, match="409"):
            await asyncio.wait_for(pending, 5)
        # Pulling again now: nobody answers for the consumer.
        with pytest.raises(ConsumerGone):
            await asyncio.wait_for(puller.fetch(1, 1.0), 5)
    finally:
        await puller.stop()
