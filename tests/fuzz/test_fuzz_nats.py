"""Garbage on the bus (issue #11, item 3): a buggy or hostile internal
publisher sends random bodies and headers onto every subject a service
listens on (route, infer, the micro-batch stream, idle signals, registry
events, audit, gateway inboxes). No service crashes, and a good request is
still answered afterwards.

``INFERBUS_FUZZ_EXAMPLES=10000`` runs the long variant.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import nats
import pytest
from hypothesis import HealthCheck, given, settings

from inferbus_common.subjects import Subjects
from inferbus_testing.hostile import examples, nats_garbage, record

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

S = Subjects()


@pytest.fixture(scope="module")
def bus(fuzz_stack):
    """A NATS client on its own event loop thread (hypothesis tests are synchronous)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    nc = run(nats.connect(fuzz_stack.nats.url))
    yield nc, run
    run(nc.drain())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def _subjects(stack) -> list[str]:
    pool, model, version = "default", "fraud", "1"
    gateway_inbox = "ib.reply.>"  # any gateway's inbox (a literal '>' token is garbage too)
    return [
        S.route(model),
        S.route("nope"),
        S.infer(model, version),
        S.infer(model, "999"),
        S.batch(pool, model, version),
        S.idle(pool, model, version),
        f"{S.prefix}.events.registry.{model}",
        f"{S.prefix}.audit.{model}",
        gateway_inbox.replace(">", "x.1"),
        gateway_inbox.replace(">", "x.b"),  # a gateway's reply-bundle inbox
    ]


def test_garbage_on_every_subject_crashes_nothing(fuzz_stack, bus) -> None:
    nc, run = bus
    js = nc.jetstream()
    subjects = _subjects(fuzz_stack)
    batch_subject = S.batch("default", "fraud", "1")
    counts: collections.Counter[str] = collections.Counter()

    async def send(subject: str, headers: dict[str, str], body: bytes) -> None:
        if subject == batch_subject:
            try:
                await js.publish(subject, body, headers=headers or None, timeout=2)
            except (nats.errors.Error, nats.js.errors.Error):
                counts["refused-by-stream"] += 1
        else:
            await nc.publish(subject, body, headers=headers or None)

    @settings(
        max_examples=examples(),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(message=nats_garbage(subjects))
    def check(message: tuple[str, dict[str, str], bytes]) -> None:
        subject, headers, body = message
        run(send(subject, headers, body))
        counts[subject.split(".")[1]] += 1

    check()
    run(nc.flush())
    record("nats", counts)
    print(dict(counts))
    fuzz_stack.assert_serving()
