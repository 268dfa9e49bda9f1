"""How many messages a queue group member loses when it leaves mid-stream:
nats-py's ``Subscription.drain`` against `inferbus_common.bus.leave`.

A publisher sends numbered messages to a group of two on a real nats-server;
after 50 ms one member leaves; every message must reach one of the two. The
arms alternate, trial by trial.

    uv run python bench/queue_leave.py [--trials 20] [--messages 20000]

Round 22 in bench/findings.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
from pathlib import Path

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common import bus
from inferbus_testing.servers import NatsServer


async def _drain(sub: Subscription) -> None:
    await sub.drain()


ARMS = {"drain": _drain, "leave": bus.leave}


async def _trial(url: str, how: str, messages: int) -> int:
    """Messages that reached neither member."""
    pub, a, b = [await nats.connect(url) for _ in range(3)]
    got: set[int] = set()

    async def take(msg: Msg) -> None:
        got.add(int(msg.data))

    try:
        sa = await a.subscribe("q", queue="g", cb=take, pending_msgs_limit=-1)
        await b.subscribe("q", queue="g", cb=take, pending_msgs_limit=-1)
        await bus.sync(a)
        await bus.sync(b)

        async def send() -> None:
            for i in range(messages):
                await pub.publish("q", str(i).encode())
                if i % 50 == 0:
                    await asyncio.sleep(0)
            await pub.flush()

        sending = asyncio.create_task(send())
        await asyncio.sleep(0.05)
        await ARMS[how](sa)
        await sending
        await bus.sync(pub)
        await bus.sync(b)
        await asyncio.sleep(0.3)
        return messages - len(got)
    finally:
        for nc in (pub, a, b):
            await nc.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="leaves per arm")
    parser.add_argument("--messages", type=int, default=20_000, help="per trial")
    args = parser.parse_args()
    lost: dict[str, list[int]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp)) as server:
        for _ in range(args.trials):
            for how in ARMS:
                lost[how].append(await _trial(server.url, how, args.messages))
    print("| arm | leaves that lost messages | messages lost (total) | most in one leave |")
    print("|---|---:|---:|---:|")
    for how, counts in lost.items():
        hit = sum(1 for n in counts if n)
        print(f"| {how} | {hit} of {len(counts)} | {sum(counts)} | {max(counts)} |")


if __name__ == "__main__":
    asyncio.run(main())
