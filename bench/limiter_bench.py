"""Benchmark of the gateway's cluster rate limiter: added latency and accuracy.

Starts a real ``redis-server`` (or uses ``--redis-url``), then

1. **latency**: one limiter, a limit far above the offered load, N sequential
   ``acquire()`` calls each timed with ``perf_counter`` — mean, p50, p99, max
   and Redis calls per request (leases make it about 1/lease size);
2. **accuracy**: ``--gateways`` limiters (each its own Redis connection, as
   separate gateways would have) offered ``--overload`` × the limit for
   ``--seconds``; prints admitted/limit.

Run: ``uv run python bench/limiter_bench.py [--qps 500] [--seconds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

from inferbus_common.admission.keys import AdmissionKeys, connect_redis
from inferbus_common.admission.limits import Limit, Scope, set_limit
from inferbus_common.errors import ResourceExhausted
from inferbus_gateway.admission.ratelimit import REDIS_CALLS, RateLimiter
from inferbus_testing.servers import RedisServer

KEYS = AdmissionKeys("bench")


async def latency(url: str, calls: int, paced_rate: float = 0.0) -> None:
    """Time `calls` acquire() calls under a limit that never rejects.

    Back to back by default (a closed loop: leases are fetched on the request
    path), or `paced_rate` calls a second (the event loop is idle between calls,
    as in a gateway, so leases are fetched ahead in the background).
    """
    admin = connect_redis(url)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "lat", 10_000_000))
    await set_limit(admin, KEYS, Limit(Scope.TENANT_MODEL, "*:lat", 10_000_000))
    await admin.aclose()
    client = connect_redis(url)
    async with RateLimiter(client, KEYS, instance_id="bench-lat") as rl:
        for _ in range(1000):  # warm-up: scripts loaded, connection open
            await rl.acquire(interface="ModelInfer", model="lat", tenant="acme")
        samples = []
        calls0 = REDIS_CALLS._value.get()
        start = time.monotonic()
        for i in range(calls):
            if paced_rate and (delay := start + i / paced_rate - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            t0 = time.perf_counter()
            await rl.acquire(interface="ModelInfer", model="lat", tenant="acme")
            samples.append((time.perf_counter() - t0) * 1e6)
        redis_calls = REDIS_CALLS._value.get() - calls0
    await client.aclose()
    samples.sort()
    mode = f"paced at {paced_rate:g}/s" if paced_rate else "back to back"
    print(
        f"latency  ({calls} acquire() calls, 2 scopes, {mode}): "
        f"mean {statistics.fmean(samples):.1f} µs, "
        f"p50 {samples[len(samples) // 2]:.1f} µs, p99 {samples[int(len(samples) * 0.99)]:.1f} µs, "
        f"max {samples[-1]:.0f} µs; Redis calls per request {redis_calls / calls:.3f}"
    )


async def _offer(rl: RateLimiter, rate: float, seconds: float, start: float) -> list[float]:
    """Offer `rate` req/s for `seconds` from `start`; returns the admission times."""
    admitted: list[float] = []
    n = 0
    while (due := start + n / rate) - start < seconds:
        if (delay := due - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        n += 1
        with contextlib.suppress(ResourceExhausted):
            await rl.acquire(interface="ModelInfer", model="acc", tenant="acme")
            admitted.append(time.monotonic())
    return admitted


async def accuracy(url: str, qps: float, seconds: float, gateways: int, overload: float) -> None:
    """Several limiters offered `overload` × `qps` for `seconds`; admitted vs limit.

    Prints the rate over the whole run (which includes the bucket's initial burst,
    10 % of a second's worth by default) and over the run after its first 0.5 s.
    """
    admin = connect_redis(url)
    await set_limit(admin, KEYS, Limit(Scope.MODEL, "acc", qps))
    await admin.aclose()
    clients = [connect_redis(url) for _ in range(gateways)]
    async with contextlib.AsyncExitStack() as stack:
        rls = [
            await stack.enter_async_context(RateLimiter(c, KEYS, instance_id=f"bench-{i}"))
            for i, c in enumerate(clients)
        ]
        start = time.monotonic()
        admitted = await asyncio.gather(
            *(_offer(rl, qps * overload / gateways, seconds, start) for rl in rls)
        )
    for c in clients:
        await c.aclose()
    rate = sum(len(a) for a in admitted) / seconds
    steady = sum(1 for a in admitted for t in a if t >= start + 0.5) / (seconds - 0.5)
    print(
        f"accuracy ({gateways} gateways, {overload:g}x of {qps:g}/s for {seconds:g}s): "
        f"admitted {rate:.1f}/s = {rate / qps:.3f} of the limit over the whole run, "
        f"{steady / qps:.3f} after the first 0.5 s "
        f"(per gateway: {', '.join(str(len(a)) for a in admitted)})"
    )


async def main() -> None:
    """Parse arguments and run both measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--paced-calls", type=int, default=3000)
    parser.add_argument("--paced-rate", type=float, default=2000.0)
    parser.add_argument("--qps", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--overload", type=float, default=2.0)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(RedisServer()).url
        await latency(url, args.calls)
        await latency(url, args.paced_calls, args.paced_rate)
        await accuracy(url, args.qps, args.seconds, args.gateways, args.overload)


if __name__ == "__main__":
    asyncio.run(main())
