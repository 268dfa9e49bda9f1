"""The gateway's dispatcher: direct dispatch, request bundles and reply fan-out
(real nats-server; a test subscriber plays the batcher)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from inferbus_common import bus
from inferbus_common.catalog import Route
from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from inferbus_common.protocol.bundles import (
    BundledReply,
    RequestBundle,
    decode_request_bundle,
    encode_reply_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects
from inferbus_gateway.dispatch.dispatcher import Dispatcher
from inferbus_gateway.dispatch.metrics import DUPLICATE_REPLIES
from inferbus_gateway.dispatch.plain import plain_version

SUBJECTS = Subjects("ib")


@pytest.mark.parametrize(
    ("route", "pinned", "expected"),
    [
        (None, "", ""),
        (Route(model="m", stable="3"), "", "3"),
        (Route(model="m", stable="3", versions=["2", "3"]), "2", "2"),  # pin: decided
        (Route(model="m", stable="3", aliases={"best": "2"}), "best", "2"),
        (Route(model="m", stable="3"), "9", ""),  # names nothing: the router refuses it
        (Route(model="m", stable="3", canary="4", canary_weight=10), "canary", "4"),
        (Route(model="m", stable="3", shadow="4", shadow_rate=0.5), "3", ""),
        (Route(model="m", stable="3", canary="4", canary_weight=10), "", ""),
        (Route(model="m", stable="3", canary="4", canary_weight=0), "", "3"),
        (Route(model="m", stable="3", canary="3", canary_weight=50), "", "3"),
        (Route(model="m", stable="3", shadow="4", shadow_rate=0.5), "", ""),
        (Route(model="m", stable="3", shadow="4", shadow_rate=0.0), "", "3"),
        (Route(model="m", stable="3", canary="4", canary_weight=10, sticky="tenant"), "", ""),
    ],
)
def test_plain_version(route: Route | None, pinned: str, expected: str):
    assert plain_version(route, pinned) == expected


class FakeBatcher:
    """Subscribes to a subject and answers like a batcher/worker would.

    Request bundles get a reply bundle echoing each request's input as output
    (or an error for requests whose id starts with ``bad``); anything else
    fails the test (bundles are the only request framing). ``hold`` keeps
    answers back until released.
    """

    def __init__(self, nc, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self.seen: list[tuple[str, RequestBundle]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.arrived = asyncio.Event()
        self.sub = None
        self._answers: set[asyncio.Task] = set()

    async def start(self) -> FakeBatcher:
        self.sub = await self.nc.subscribe(self.subject, cb=self._on_msg)
        await bus.sync(self.nc)
        return self

    async def stop(self) -> None:
        await self.sub.unsubscribe()

    @property
    def bundles(self) -> list[RequestBundle]:
        return [b for _, b in self.seen]

    async def _on_msg(self, msg) -> None:
        # Recorded at once, answered in a task: a held answer does not hold the
        # subscription, so later messages are seen while it waits.
        self.seen.append((msg.subject, decode_request_bundle(msg.data)))
        self.arrived.set()
        task = asyncio.ensure_future(self._answer(self.seen[-1][1]))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    async def _answer(self, bundle: RequestBundle) -> None:
        await self.hold.wait()
        replies, frames = [], []
        for r in bundle.requests:
            if r.envelope.request_id.startswith("bad"):
                replies.append(BundledReply(r.token, "INVALID_ARGUMENT", "bad input"))
                frames.append(())
            else:
                replies.append(BundledReply(r.token, queue_ms=0.5))
                frames.append((bytes(r.frame),))
        await self.nc.publish(
            bundle.inbox,
            encode_reply_bundle(bundle.version or "3", "d1", "compute=0.1", 1, replies, frames),
        )


def _tensors(value: float = 0.0, rows: int = 1):
    return [tensor_from_numpy("input", np.full((rows, 4), value, np.float32))]


async def _call(
    dispatcher: Dispatcher,
    route: Route | None,
    version: str = "",
    *,
    request_id: str = "r1",
    value: float = 0.0,
    rows: int = 1,
    **kwargs,
):
    return await dispatcher.call(
        Envelope(request_id, "fraud", time.time_ns() + 10_000_000_000, version),
        _tensors(value, rows),
        route=route,
        **kwargs,
    )


@pytest.fixture
async def dispatchers(nats_client):
    made: list[Dispatcher] = []

    async def make(name: str, **kwargs) -> Dispatcher:
        d = Dispatcher(nats_client, SUBJECTS, name, **kwargs)
        await d.start()
        made.append(d)
        return d

    yield make
    for d in made:
        await d.stop()


async def test_direct_dispatch_skips_the_router_when_it_has_nothing_to_do(nats_client, dispatchers):
    router = await FakeBatcher(nats_client, SUBJECTS.route("fraud")).start()
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    direct = await dispatchers("gw-direct", direct=True)
    via_router = await dispatchers("gw-router")
    try:
        plain = Route(model="fraud", stable="3")
        canary = Route(model="fraud", stable="3", canary="4", canary_weight=20)

        reply = await _call(direct, plain)
        assert reply.version == "3"
        assert len(batcher.seen) == 1 and not router.seen
        bundle = batcher.bundles[0]
        assert (bundle.model, bundle.version) == ("fraud", "3")
        assert bundle.requests[0].envelope.version == ""

        await _call(direct, canary)  # a canary takes traffic: the router decides
        shadowed = Route(model="fraud", stable="3", shadow="4", shadow_rate=0.5)
        await _call(direct, shadowed, version="3")  # pinned, but a shadow copy to send
        await _call(via_router, plain)  # direct off: always the router
        assert len(router.seen) == 3 and len(batcher.seen) == 1
        await _call(direct, plain, version="3")  # pinned, nothing else to do: direct
        assert len(router.seen) == 3 and len(batcher.seen) == 2
        assert [b.version for b in router.bundles] == ["", "", ""]
        assert [b.requests[0].envelope.version for b in router.bundles] == ["", "3", ""]
    finally:
        await router.stop()
        await batcher.stop()


async def test_the_subject_follows_the_route_object_it_was_found_for(nats_client, dispatchers):
    """The subject is kept per (model, pin) only while the route is the same object:
    a new route (the catalog replaces it on every change) is looked at again."""
    router = await FakeBatcher(nats_client, SUBJECTS.route("fraud")).start()
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    direct = await dispatchers("gw-kept", direct=True)
    try:
        plain = Route(model="fraud", stable="3")
        canary = Route(model="fraud", stable="3", canary="4", canary_weight=20)
        for route in (plain, plain, canary, canary, Route(model="fraud", stable="3")):
            await _call(direct, route)
        assert (len(batcher.seen), len(router.seen)) == (3, 2)
    finally:
        await router.stop()
        await batcher.stop()


async def test_direct_dispatch_without_batchers_is_unavailable_at_once(dispatchers):
    direct = await dispatchers("gw-none", direct=True, bundle_window_s=30.0)
    # nats-server's no-responders answer, not the deadline (DeadlineExceeded).
    with pytest.raises(Unavailable, match="no batcher"):
        await asyncio.wait_for(_call(direct, Route(model="fraud", stable="9")), 10)
    results = await asyncio.wait_for(
        asyncio.gather(
            *(_call(direct, Route(model="fraud", stable="9")) for _ in range(3)),
            return_exceptions=True,
        ),
        10,
    )
    assert all(isinstance(r, Unavailable) for r in results)
    assert direct.in_flight == 0


async def test_requests_of_one_loop_turn_travel_as_one_bundle(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    # A window far longer than the test: nothing is in flight, so the bundle
    # must go at the end of the loop turn, not after the window.
    d = await dispatchers("gw-b", direct=True, bundle_window_s=60.0)
    plain = Route(model="fraud", stable="3")
    try:
        replies = await asyncio.wait_for(
            asyncio.gather(
                *(_call(d, plain, request_id=f"r{i}", value=float(i)) for i in range(5)),
                _call(d, plain, request_id="bad-1"),
                return_exceptions=True,
            ),
            10,
        )
        assert len(batcher.bundles) == 1
        assert [r.envelope.request_id for r in batcher.bundles[0].requests] == [
            *(f"r{i}" for i in range(5)),
            "bad-1",
        ]
        # Every call got its own row back, and only its own.
        for i, reply in enumerate(replies[:5]):
            out = decode_tensors(reply.frame)[0].as_numpy()
            assert out.shape == (1, 4) and np.all(out == i)
            assert reply.timings_ms == {"queue": 0.5, "compute": 0.1}
            assert (reply.version, reply.digest) == ("3", "d1")
        # An error answer is a reply too; `_infer` raises it.
        with pytest.raises(InvalidArgument, match="bad input"):
            replies[5].raise_for_status()
        assert d.in_flight == 0
    finally:
        await batcher.stop()


async def test_a_subject_that_is_not_busy_never_waits(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers("gw-nb", direct=True, bundle_window_s=60.0, busy=lambda: False)
    plain = Route(model="fraud", stable="3")
    try:
        batcher.hold.clear()
        calls = []
        for i in range(4):  # few waiting: each goes in its own loop turn
            calls.append(asyncio.ensure_future(_call(d, plain, request_id=f"r{i}")))
            await asyncio.sleep(0.01)
        for _ in range(200):
            if len(batcher.bundles) == 4:
                break
            await asyncio.sleep(0.01)
        assert [len(b.requests) for b in batcher.bundles] == [1, 1, 1, 1]
        batcher.hold.set()
        await asyncio.wait_for(asyncio.gather(*calls), 10)
    finally:
        batcher.hold.set()
        await batcher.stop()


async def test_a_busy_gateway_collects_requests_for_the_window(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers(
        "gw-w", direct=True, bundle_window_s=0.4, busy=lambda: True, bundle_release_on_reply=False
    )
    plain = Route(model="fraud", stable="3")
    try:
        batcher.hold.clear()
        calls = []
        t0 = time.monotonic()
        for i in range(4):  # loop turns apart
            calls.append(asyncio.ensure_future(_call(d, plain, request_id=f"w{i}")))
            await asyncio.sleep(0.02)
        # The first found nothing in flight and went alone; the others, with it in
        # flight and CPU short, collect in one bundle for the window.
        assert [len(b.requests) for b in batcher.bundles] == [1]
        batcher.hold.set()
        await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert 0.3 <= time.monotonic() - t0 < 5.0
        assert [len(b.requests) for b in batcher.bundles] == [1, 3]
        assert d.in_flight == 0
    finally:
        batcher.hold.set()
        await batcher.stop()


@pytest.mark.parametrize(("release", "cpu_short"), [(True, False), (False, False), (True, True)])
async def test_a_held_bundle_goes_when_a_sent_bundle_of_its_subject_is_answered(
    nats_client, dispatchers, release, cpu_short
):
    """The version's one slot has this gateway's bundle, so the next requests are
    held; when that bundle is answered the slot has finished a batch and the held
    bundle goes then, not at the end of its (here 60 s) window. It keeps waiting
    with `bundle_release_on_reply` off, and while CPU is short (fuller bundles)."""
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers(
        f"gw-rel-{release}-{cpu_short}",
        direct=True,
        bundle_window_s=60.0,
        busy=lambda: cpu_short,
        bundle_per_slot=1,
        slots=lambda model, version: 1,
        bundle_release_on_reply=release,
    )
    plain = Route(model="fraud", stable="3")
    try:
        batcher.hold.clear()
        first = asyncio.ensure_future(_call(d, plain, request_id="lead"))
        await asyncio.sleep(0.02)
        held = []
        for i in range(3):  # loop turns apart, the first in flight: held
            held.append(asyncio.ensure_future(_call(d, plain, request_id=f"h{i}")))
            await asyncio.sleep(0.02)
        assert [len(b.requests) for b in batcher.bundles] == [1]
        batcher.hold.set()  # the lead's bundle is answered
        await asyncio.wait_for(first, 5)
        if release and not cpu_short:
            await asyncio.wait_for(asyncio.gather(*held), 5)
            assert [len(b.requests) for b in batcher.bundles] == [1, 3]
            assert d.in_flight == 0
        else:
            await asyncio.sleep(0.3)
            assert [len(b.requests) for b in batcher.bundles] == [1]
            assert not any(c.done() for c in held)
            for c in held:
                c.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    finally:
        batcher.hold.set()
        await batcher.stop()


async def test_requests_that_queue_downstream_collect_for_the_window(nats_client, dispatchers):
    """With CPU to spare, a bundle still collects requests for the window once
    more than `bundle_per_slot` per execution slot of the version would be in
    flight here (they wait downstream anyway); up to that, each goes at once."""
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers(
        "gw-q",
        direct=True,
        bundle_window_s=0.4,
        busy=lambda: False,
        bundle_per_slot=2,
        slots=lambda model, version: 2,
    )
    plain = Route(model="fraud", stable="3")
    try:
        batcher.hold.clear()
        calls = []

        async def bundles(n: int) -> list[int]:
            for _ in range(500):
                if len(batcher.bundles) >= n:
                    break
                await asyncio.sleep(0.01)
            return [len(b.requests) for b in batcher.bundles]

        for i in range(4):  # up to 2 per slot x 2 slots: each goes alone, at once
            calls.append(asyncio.ensure_future(_call(d, plain, request_id=f"q{i}")))
            await asyncio.sleep(0.01)
        assert await bundles(4) == [1, 1, 1, 1]
        t0 = time.monotonic()
        for i in range(4, 7):  # the fifth on: loop turns apart, one bundle for the window
            calls.append(asyncio.ensure_future(_call(d, plain, request_id=f"q{i}")))
            await asyncio.sleep(0.02)
        assert [len(b.requests) for b in batcher.bundles] == [1, 1, 1, 1]  # held
        assert await bundles(5) == [1, 1, 1, 1, 3]
        assert 0.3 <= time.monotonic() - t0 < 5.0
        batcher.hold.set()
        await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert d.in_flight == 0
        # Through the router (no version known here) only the CPU rule holds: six
        # requests loop turns apart, answers held, still go one by one.
        router = await FakeBatcher(nats_client, SUBJECTS.route("fraud")).start()
        try:
            router.hold.clear()
            canary = Route(model="fraud", stable="3", canary="4", canary_weight=10)
            routed = []
            for i in range(6):
                routed.append(asyncio.ensure_future(_call(d, canary, request_id=f"c{i}")))
                await asyncio.sleep(0.01)
            for _ in range(500):
                if len(router.bundles) >= 6:
                    break
                await asyncio.sleep(0.01)
            assert [len(b.requests) for b in router.bundles] == [1] * 6
            router.hold.set()
            await asyncio.wait_for(asyncio.gather(*routed), 10)
        finally:
            router.hold.set()
            await router.stop()
    finally:
        batcher.hold.set()
        await batcher.stop()


@pytest.mark.parametrize(("deep", "expected"), [(3, [6, 1, 2]), (0, [6, 1, 1, 1])])
async def test_many_requests_in_flight_hold_from_one_bundle_per_slot(
    nats_client, dispatchers, deep: int, expected: list[int]
):
    """``bundle_deep_per_slot=3`` with two slots: from six requests in flight here on,
    one unanswered bundle per slot holds new ones (not `bundle_per_slot`, two). Six
    requests in one loop turn go as one bundle; of three more, loop turns apart and
    answers held, the first goes (one bundle per slot is out), the other two wait
    together for the window. Without it (0) all three go alone."""
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers(
        f"gw-deep-{deep}",
        direct=True,
        bundle_window_s=0.3,
        busy=lambda: False,
        bundle_per_slot=2,
        bundle_deep_per_slot=deep,
        slots=lambda model, version: 2,
    )
    plain = Route(model="fraud", stable="3")
    try:
        batcher.hold.clear()
        calls = [asyncio.ensure_future(_call(d, plain, request_id=f"q{i}")) for i in range(6)]
        await asyncio.sleep(0.02)
        for i in range(6, 9):
            calls.append(asyncio.ensure_future(_call(d, plain, request_id=f"q{i}")))
            await asyncio.sleep(0.02)
        for _ in range(500):
            if sum(len(b.requests) for b in batcher.bundles) == 9:
                break
            await asyncio.sleep(0.01)
        assert [len(b.requests) for b in batcher.bundles] == expected
        batcher.hold.set()
        await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert d.in_flight == 0
    finally:
        batcher.hold.set()
        await batcher.stop()


async def test_a_bundle_goes_when_its_rows_fill_a_batch(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers("gw-f", direct=True, bundle_window_s=60.0, busy=lambda: True)
    plain = Route(model="fraud", stable="3")
    try:
        # max_rows 4: two requests of two rows fill it, the bundle goes without
        # waiting for the 60 s window.
        full = await asyncio.wait_for(
            asyncio.gather(
                *(_call(d, plain, request_id=f"f{i}", rows=2, max_rows=4) for i in range(2))
            ),
            10,
        )
        assert len(full) == 2
        assert [len(b.requests) for b in batcher.bundles] == [2]
    finally:
        batcher.hold.set()
        await batcher.stop()


async def test_duplicate_and_late_replies_are_dropped(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers("gw-dup", direct=True)
    plain = Route(model="fraud", stable="3")
    try:
        await _call(d, plain)
        bundle = batcher.bundles[0]
        token = bundle.requests[0].token
        before = DUPLICATE_REPLIES.value
        # A redelivered batch answers again: nobody waits, it is counted and dropped.
        await nats_client.publish(
            bundle.inbox,
            encode_reply_bundle("3", "d1", "", 1, [BundledReply(token)], [(b"",)]),
        )
        await bus.sync(nats_client)
        for _ in range(100):
            if DUPLICATE_REPLIES.value > before:
                break
            await asyncio.sleep(0.02)
        assert DUPLICATE_REPLIES.value == before + 1
        assert d.in_flight == 0
    finally:
        await batcher.stop()


async def test_a_call_past_its_deadline_leaves_nothing_behind(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers("gw-dl", direct=True)
    try:
        batcher.hold.clear()
        with pytest.raises(DeadlineExceeded):
            await d.call(
                Envelope("slow", "fraud", time.time_ns() + 200_000_000),
                _tensors(),
                route=Route(model="fraud", stable="3"),
            )
        assert d.in_flight == 0
    finally:
        batcher.hold.set()
        await batcher.stop()


async def test_a_request_larger_than_a_bus_message_is_refused(dispatchers):
    d = await dispatchers("gw-big", direct=True)
    rows = 2 * (1 << 20) // (4 * 4)  # 2 MiB of FP32, over nats-server's 1 MiB default
    with pytest.raises(InvalidArgument, match="max_payload"):
        await _call(d, Route(model="fraud", stable="3"), rows=rows)
    assert d.in_flight == 0


async def test_a_lone_request_never_waits_even_when_cpu_is_short(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers("gw-lone", direct=True, bundle_window_s=60.0, busy=lambda: True)
    try:
        # Nothing else in flight: the bundle goes at the end of the turn, not in 60 s.
        reply = await asyncio.wait_for(_call(d, Route(model="fraud", stable="3")), 10)
        assert reply.version == "3"
    finally:
        await batcher.stop()


async def test_the_inbox_takes_reply_bundles_only(nats_client, dispatchers):
    """A reply in the old single form (headers, on ``<inbox>.<token>``) answers
    nothing: the call waits for its reply bundle."""
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    d = await dispatchers("gw-one", direct=True)
    try:
        batcher.hold.clear()
        call = asyncio.ensure_future(_call(d, Route(model="fraud", stable="3")))
        await asyncio.wait_for(batcher.arrived.wait(), 10)
        bundle = batcher.bundles[0]
        token = bundle.requests[0].token
        inbox = bundle.inbox.rsplit(".", 1)[0]
        await nats_client.publish(f"{inbox}.{token}", b"", headers={"Ib-Status": "INTERNAL"})
        await bus.sync(nats_client)
        assert not call.done()
        batcher.hold.set()
        reply = await asyncio.wait_for(call, 10)
        reply.raise_for_status()  # the bundle's OK, not the single form's INTERNAL
    finally:
        batcher.hold.set()
        await batcher.stop()


async def test_fail_pending_answers_the_waiting_requests_of_one_version(nats_client, dispatchers):
    """`Dispatcher.fail_pending` (a version lost its last worker, noworker.py): the
    requests sent to it that wait for a reply, by deadline, and nothing else."""
    batcher3 = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    batcher4 = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "4")).start()
    d = await dispatchers("gw-lost", direct=True)
    route = Route(model="fraud", stable="3", versions=["3", "4"])
    now = time.time_ns()
    try:
        batcher3.hold.clear()
        batcher4.hold.clear()

        def send(rid: str, version: str, deadline_s: float) -> asyncio.Future:
            envelope = Envelope(rid, "fraud", now + int(deadline_s * 1e9), version)
            return asyncio.ensure_future(d.call(envelope, _tensors(), route=route))

        soon, late, other = send("soon", "3", 5), send("late", "3", 20), send("other", "4", 5)
        await asyncio.wait_for(batcher3.arrived.wait(), 5)
        await asyncio.wait_for(batcher4.arrived.wait(), 5)
        assert d.in_flight == 3
        lost = Unavailable("model 'fraud' version '3': no worker serves it")
        assert d.fail_pending("fraud", "3", now + 10 * 10**9, lost) == 1  # due within 10 s
        with pytest.raises(Unavailable, match="no worker serves it"):
            await soon
        assert not late.done() and not other.done()
        assert d.fail_pending("fraud", "3", None, lost) == 1  # all of them
        with pytest.raises(Unavailable, match="no worker serves it"):
            await late
        assert d.fail_pending("fraud", "3", None, lost) == 0
        batcher4.hold.set()
        assert (await other).status == ""  # another version: answered by its worker
        assert d.in_flight == 0
    finally:
        batcher3.hold.set()
        batcher4.hold.set()
        await batcher3.stop()
        await batcher4.stop()


class FakeFastWorker(FakeBatcher):
    """A worker on the fast lane: answers like `FakeBatcher` (``mode="answer"``),
    refuses (``"busy"``), keeps requests alive with empty messages on their reply
    subject until released (``"keepalive"``), or says nothing (``"silent"``)."""

    def __init__(self, nc, subject: str, mode: str = "answer") -> None:
        super().__init__(nc, subject)
        self.mode = mode
        self.release = asyncio.Event()

    async def _on_msg(self, msg) -> None:
        bundle = decode_request_bundle(msg.data)
        self.seen.append((msg.subject, bundle))
        if self.mode == "busy":
            await self.nc.publish(msg.reply, b"busy")
        elif self.mode == "answer":
            await self._answer(bundle)
        elif self.mode == "keepalive":
            task = asyncio.ensure_future(self._keep(msg.reply, bundle))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)

    async def _keep(self, reply: str, bundle: RequestBundle) -> None:
        while not self.release.is_set():
            await self.nc.publish(reply, b"")
            await asyncio.sleep(0.03)
        await self._answer(bundle)


async def test_fast_lane_takes_lone_requests_on_plain_routes(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    router = await FakeBatcher(nats_client, SUBJECTS.route("fraud")).start()
    worker = await FakeFastWorker(nats_client, SUBJECTS.fast("fraud", "3")).start()
    fast = await dispatchers("gw-fast", direct=True, fast_lane=True)
    off = await dispatchers("gw-fast-off", direct=True)
    try:
        plain = Route(model="fraud", stable="3")
        reply = await _call(fast, plain, value=2.0)
        assert reply.version == "3" and not reply.status
        assert decode_tensors(reply.frame)[0].as_numpy()[0, 0] == 2.0
        assert len(worker.seen) == 1 and not batcher.seen
        await _call(fast, plain, version="3")  # a pin decided here: the lane too
        assert len(worker.seen) == 2
        # A canary taking traffic: the router decides, never the lane.
        await _call(fast, Route(model="fraud", stable="3", canary="4", canary_weight=20))
        assert len(router.seen) == 1 and len(worker.seen) == 2
        await _call(off, plain)  # lane off: the batcher
        assert len(batcher.seen) == 1 and len(worker.seen) == 2
        # Several in flight at once (one loop turn: one bundle of three): not lone.
        await asyncio.gather(*(_call(fast, plain, request_id=f"r{i}") for i in range(3)))
        assert len(batcher.seen) == 2 and len(worker.seen) == 2
    finally:
        for sub in (batcher, router, worker):
            await sub.stop()


async def test_fast_lane_takes_up_to_two_requests_in_flight_per_execution_slot(
    nats_client, dispatchers
):
    """Requests one loop turn apart (each a bundle of one) take the lane while at most
    two per execution slot of the version are in flight here; the next ones go
    through the batcher. Without `slots` only `fast_lane_max_in_flight` (1) counts."""
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    worker = await FakeFastWorker(nats_client, SUBJECTS.fast("fraud", "3"), "keepalive").start()
    asked: list[tuple[str, str]] = []

    def slots(model: str, version: str) -> int:
        asked.append((model, version))
        return 2  # e.g. two ready workers of instance_count 1

    per_slot = await dispatchers(
        "gw-slot", direct=True, fast_lane=True, fast_lane_per_slot=2, slots=slots
    )
    lone_only = await dispatchers("gw-slot-1", direct=True, fast_lane=True)
    plain = Route(model="fraud", stable="3")
    try:
        for d, lane_takes in ((per_slot, 4), (lone_only, 1)):
            worker.release.clear()  # lane requests stay running (kept alive)
            batcher.hold.clear()
            before_lane, before_batcher = len(worker.seen), len(batcher.seen)
            calls = []
            for i in range(6):  # loop turns apart: six bundles of one
                calls.append(asyncio.ensure_future(_call(d, plain, request_id=f"p{i}")))
                await asyncio.sleep(0.02)
            assert len(worker.seen) - before_lane == lane_takes
            assert len(batcher.seen) - before_batcher == 6 - lane_takes
            worker.release.set()
            batcher.hold.set()
            await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert asked and set(asked) == {("fraud", "3")}
    finally:
        worker.release.set()
        batcher.hold.set()
        for sub in (batcher, worker):
            await sub.stop()


async def test_fast_lane_refused_or_unserved_goes_the_normal_way_at_once(nats_client, dispatchers):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    fast = await dispatchers("gw-fast-fb", direct=True, fast_lane=True, fast_lane_retry_s=30.0)
    plain = Route(model="fraud", stable="3")
    try:
        # No worker on the lane: nats-server's no responders, then the batcher.
        t0 = time.monotonic()
        reply = await asyncio.wait_for(_call(fast, plain, value=1.0), 5)
        assert decode_tensors(reply.frame)[0].as_numpy()[0, 0] == 1.0
        assert len(batcher.seen) == 1
        # A busy worker refuses: the same bundle (same token) goes to the batcher.
        worker = await FakeFastWorker(nats_client, SUBJECTS.fast("fraud", "3"), "busy").start()
        try:
            reply = await asyncio.wait_for(_call(fast, plain, value=4.0), 5)
            assert decode_tensors(reply.frame)[0].as_numpy()[0, 0] == 4.0
            assert len(worker.seen) == 1 and len(batcher.seen) == 2
            assert worker.bundles[0].requests[0].token == batcher.bundles[1].requests[0].token
        finally:
            await worker.stop()
        assert time.monotonic() - t0 < 5  # neither waited for the 30 s retry
    finally:
        await batcher.stop()


async def test_fast_lane_retries_a_silent_worker_and_keeps_the_first_answer(
    nats_client, dispatchers
):
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    fast = await dispatchers("gw-fast-rt", direct=True, fast_lane=True, fast_lane_retry_s=0.1)
    plain = Route(model="fraud", stable="3")
    worker = await FakeFastWorker(nats_client, SUBJECTS.fast("fraud", "3"), "silent").start()
    try:
        # Silent (a dead worker): after the retry time the batcher answers.
        t0 = time.monotonic()
        reply = await asyncio.wait_for(_call(fast, plain, value=5.0), 5)
        assert 0.09 < time.monotonic() - t0 < 2
        assert decode_tensors(reply.frame)[0].as_numpy()[0, 0] == 5.0
        assert len(worker.seen) == 1 and len(batcher.seen) == 1
        # Keep-alives (a long run): no retry, the worker's answer is the one.
        worker.mode = "keepalive"
        call = asyncio.ensure_future(_call(fast, plain, value=6.0))
        await asyncio.sleep(0.4)  # four retry times
        assert not call.done() and len(batcher.seen) == 1
        worker.release.set()
        reply = await asyncio.wait_for(call, 5)
        assert decode_tensors(reply.frame)[0].as_numpy()[0, 0] == 6.0
        assert len(batcher.seen) == 1
        # The silent worker answers after all (it was only slow): the caller had its
        # one answer from the batcher; this one is dropped as a duplicate.
        before = DUPLICATE_REPLIES.value
        await worker._answer(worker.bundles[0])
        for _ in range(100):
            if DUPLICATE_REPLIES.value > before:
                break
            await asyncio.sleep(0.01)
        assert DUPLICATE_REPLIES.value == before + 1
    finally:
        await batcher.stop()


async def test_a_nats_user_without_the_fast_lane_switches_it_off_at_the_first_refusal(
    tmp_path,
):
    """A permissions file from before the fast lane: nats-server drops the gateway's
    publishes on ``ib.fast.>`` and says so only asynchronously. Without a reaction
    every lone request would wait `fast_lane_retry_s` (30 s here) for its fallback;
    the dispatcher switches the lane off at the first refusal and sends what was on
    it the normal way at once."""
    from inferbus_common.bus import connect
    from inferbus_gateway.dispatch.fastlane import FAST_LANE_ENABLED, FAST_LANE_SENT
    from inferbus_testing.servers import NatsServer

    conf = tmp_path / "auth.conf"
    conf.write_text(
        "authorization {\n  users = [\n"
        '    {user: gw, password: gwpw, permissions: {publish: {allow: ["ib.infer.>"]}}}\n'
        "    {user: all, password: allpw}\n  ]\n}\n"
    )
    with NatsServer(tmp_path / "nats", jetstream=False, extra_args=["-c", str(conf)]) as server:
        gw = await connect(server.url, "gw", user="gw", password="gwpw")
        other = await connect(server.url, "all", user="all", password="allpw")
        batcher = await FakeBatcher(other, SUBJECTS.infer("fraud", "3")).start()
        worker = await FakeFastWorker(other, SUBJECTS.fast("fraud", "3")).start()
        dispatcher = Dispatcher(
            gw, SUBJECTS, "gw-perm", direct=True, fast_lane=True, fast_lane_retry_s=30.0
        )
        await dispatcher.start()
        plain = Route(model="fraud", stable="3")
        try:
            assert FAST_LANE_ENABLED._value.get() == 1
            t0 = time.monotonic()
            reply = await asyncio.wait_for(_call(dispatcher, plain, value=7.0), 10)
            assert time.monotonic() - t0 < 10, "did not wait for the 30 s retry"
            assert decode_tensors(reply.frame)[0].as_numpy()[0, 0] == 7.0
            assert len(batcher.seen) == 1 and not worker.seen
            assert FAST_LANE_ENABLED._value.get() == 0
            sent = FAST_LANE_SENT.value
            # The next lone request goes the normal way from the start.
            await asyncio.wait_for(_call(dispatcher, plain, request_id="r2"), 10)
            assert len(batcher.seen) == 2 and FAST_LANE_SENT.value == sent
        finally:
            await dispatcher.stop()
            await batcher.stop()
            await worker.stop()
            await gw.close()
            await other.close()


async def test_a_bundle_released_when_its_versions_slots_are_free_takes_the_fast_lane(
    nats_client, dispatchers
):
    """Held while the version's one slot has this gateway's bundle; when that bundle
    is answered nothing of this gateway is left there, so the held bundle of three
    goes on the lane (the worker runs it as one micro-batch), not the batcher."""
    batcher = await FakeBatcher(nats_client, SUBJECTS.infer("fraud", "3")).start()
    worker = await FakeFastWorker(nats_client, SUBJECTS.fast("fraud", "3")).start()
    d = await dispatchers(
        "gw-lane-rel",
        direct=True,
        fast_lane=True,
        bundle_window_s=60.0,
        busy=lambda: False,
        bundle_per_slot=1,
        slots=lambda model, version: 1,
    )
    plain = Route(model="fraud", stable="3")
    try:
        worker.hold.clear()
        lead = asyncio.ensure_future(_call(d, plain, request_id="lead"))
        for _ in range(500):
            if worker.seen:
                break
            await asyncio.sleep(0.01)
        held = []
        for i in range(3):  # loop turns apart: the slot has the lead's bundle
            held.append(asyncio.ensure_future(_call(d, plain, request_id=f"h{i}")))
            await asyncio.sleep(0.02)
        assert [len(b.requests) for b in worker.bundles] == [1]
        worker.hold.set()
        await asyncio.wait_for(asyncio.gather(lead, *held), 5)
        assert [len(b.requests) for b in worker.bundles] == [1, 3]
        assert not batcher.seen
        assert d.in_flight == 0
    finally:
        worker.hold.set()
        await worker.stop()
        await batcher.stop()
