"""`inferbus_common.bus.leave`: a queue group member leaves without losing what
nats-server routed to it, against a real nats-server.

A publisher keeps sending to a group of two while one member leaves; every
message must reach one of the two. With nats-py's plain ``Subscription.drain``
in place of `leave` this test failed every run (5 of 5, losing 27-319 messages; its
PING overtakes the UNSUB; see `bus.leave`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from inferbus_common import bus
from inferbus_testing.servers import NatsServer

ROUNDS = 30
AFTER = 2_000
"""Messages sent after the leave returns, before the publisher stops."""


class _Group:
    """What each of two queue group members took, by message number."""

    def __init__(self) -> None:
        self.got: dict[str, set[int]] = {"a": set(), "b": set()}
        self.sent: int | None = None
        self.a_started = asyncio.Event()
        self.all_in = asyncio.Event()

    def member(self, name: str) -> Callable[[Msg], Awaitable[None]]:
        async def take(msg: Msg) -> None:
            self.got[name].add(int(msg.data))
            if len(self.got["a"]) > 100:
                self.a_started.set()
            self.check()

        return take

    def check(self) -> None:
        if self.sent is not None and len(self.got["a"]) + len(self.got["b"]) >= self.sent:
            self.all_in.set()

    def lost(self) -> int:
        return (self.sent or 0) - len(self.got["a"] | self.got["b"])


async def _leave_mid_stream(pub: Client, a: Client, b: Client, subject: str) -> None:
    group = _Group()
    sa = await a.subscribe(subject, queue="g", cb=group.member("a"), pending_msgs_limit=-1)
    sb = await b.subscribe(subject, queue="g", cb=group.member("b"), pending_msgs_limit=-1)
    await bus.sync(a)
    await bus.sync(b)
    left = asyncio.Event()

    async def send() -> int:
        i = after = 0
        while after < AFTER:
            await pub.publish(subject, str(i).encode())
            i += 1
            after += left.is_set()
            if i % 50 == 0:
                await asyncio.sleep(0)
        await pub.flush()
        return i

    # Sends from before a's leave to after it: the leave happens mid-stream.
    sending = asyncio.create_task(send())
    await asyncio.wait_for(group.a_started.wait(), 10)
    # a is busy writing as it leaves (a gateway sending answers, say): its UNSUB
    # waits behind this in nats-py's write buffer.
    await a.publish(f"{subject}.answers", bytes(512 * 1024))
    await bus.leave(sa)
    left.set()
    after_leave = len(group.got["a"])
    group.sent = await sending
    group.check()
    try:
        await asyncio.wait_for(group.all_in.wait(), 10)
    except TimeoutError:
        raise AssertionError(f"{group.lost()} of {group.sent} messages lost") from None
    assert len(group.got["a"]) == after_leave, "a took messages after it left"
    assert not group.got["a"] & group.got["b"]
    await sb.unsubscribe()


async def test_a_member_leaving_mid_stream_loses_none_of_the_groups_messages(
    tmp_path: Path,
) -> None:
    with NatsServer(tmp_path) as server:
        for round_ in range(ROUNDS):
            pub, a, b = [await nats.connect(server.url) for _ in range(3)]
            try:
                await _leave_mid_stream(pub, a, b, f"leave.{round_}")
            finally:
                for nc in (pub, a, b):
                    await nc.close()
