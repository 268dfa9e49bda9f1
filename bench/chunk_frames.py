"""What chunk frames save on the gateway's side: CPU per chunk received, framed or not.

A real nats-server; the gateway's own `GenerationDispatcher` and `ChunkStream`s in
this process read `--streams` streams of `--tokens` chunks each; a child process
publishes them as an LLM worker does, one engine step at a time (every stream's
next chunk), either one message per chunk (``single``) or one frame per step
(``frames``). The figure is this process's CPU time (``time.process_time``,
the publisher's is not in it) per chunk, from the first publish to the last
chunk read; the arms alternate, `--rounds` times each. No HTTP, no engine: only
the bus and the gateway's chunk handling, the part frames change.

    uv run python bench/chunk_frames.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import nats

from inferbus_common.generation import GenerationChunk, pack_chunk
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects
from inferbus_gateway.generation import ChunkStream, GenerationDispatcher
from inferbus_testing.servers import NatsServer


def publish(url: str, replies: list[str], frames: str, tokens: int) -> None:
    """The worker's side (run in a child process): every stream's chunk of a step,
    then the next step."""

    async def main() -> None:
        nc = await nats.connect(url)
        for step in range(tokens):
            final = step + 1 == tokens
            body = GenerationChunk(text=f" t{step}", tokens=1).encode()
            if frames:
                frame = b"".join(pack_chunk(r, step, final, body) for r in replies)
                await nc.publish(frames, frame, headers={h.VERSION: "1"})
            else:
                for r in replies:
                    hdrs = {h.SEQ: str(step), h.REQUEST_ID: r, h.VERSION: "1"}
                    if final:
                        hdrs[h.FINAL] = "1"
                    await nc.publish(r, body, headers=hdrs)
            await asyncio.sleep(0)
        await nc.flush()
        await nc.close()

    asyncio.run(main())


async def one_run(url: str, arm: str, streams: int, tokens: int, n: int) -> float:
    """CPU µs per chunk on the receiving side for one arm.

    The window runs from starting the publisher to the last chunk read; this
    process waits (no CPU) while the child starts and connects.
    """
    nc = await nats.connect(url)
    d = GenerationDispatcher(nc, Subjects(f"cf{n}"), f"gw{n}", chunk_frames=arm == "frames")
    await d.start()
    opened = [d.open() for _ in range(streams)]
    await nc.flush()

    async def read(stream: ChunkStream) -> int:
        got = 0
        async for _chunk in stream.chunks(h.deadline_from_timeout(120)):
            got += 1
        return got

    readers = asyncio.gather(*(read(s) for _, s in opened))
    config = {"url": url, "replies": [r for r, _ in opened], "frames": d.frames_subject}
    cpu0 = time.process_time()
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--publish",
        json.dumps({**config, "tokens": tokens}),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(120):
            counts = await readers
    except TimeoutError:
        _, err = await child.communicate()
        raise RuntimeError(f"the publisher did not deliver: {err.decode()[-2000:]}") from None
    cpu = time.process_time() - cpu0
    await child.wait()
    assert counts == [tokens] * streams, counts
    await d.stop()
    await nc.close()
    return 1e6 * cpu / (streams * tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--publish", help=argparse.SUPPRESS)  # the child's side (JSON)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.publish:
        c = json.loads(args.publish)
        publish(c["url"], c["replies"], c["frames"], c["tokens"])
        return
    figures: dict[str, list[float]] = {"single": [], "frames": []}
    with NatsServer(jetstream=False) as server:
        n = 0
        for rnd in range(args.rounds):
            for arm in ("single", "frames") if rnd % 2 == 0 else ("frames", "single"):
                n += 1
                us = asyncio.run(one_run(server.url, arm, args.streams, args.tokens, n))
                figures[arm].append(us)
                print(f"round {rnd} {arm:6} {us:6.1f} µs CPU per chunk received", flush=True)
    s, f = (statistics.median(figures[a]) for a in ("single", "frames"))
    print(
        f"\n{args.streams} streams × {args.tokens} chunks, {args.rounds} rounds: gateway-side "
        f"CPU per chunk, median: single {s:.1f} µs, frames {f:.1f} µs ({f / s:.2f}×)"
    )


if __name__ == "__main__":
    main()
