"""The gateway's NATS side: send requests into the platform, match replies to callers.

Requests for the same subject (a model's router subject, or a version's
batcher subject on a plain route, see `plain_version`) go out as request
bundles (`inferbus_common.protocol.bundles`): one message carries several
requests, and each reply bundle that comes back answers several waiting calls.
A lone request is a bundle of one: there is no other request framing.
A bundle goes at the end of the event-loop turn that opened it, unless CPU is
what limits (the machine's CPUs or the gateway's event loop nearly always
busy, `cpuload.CpuLoad`) and other requests are in flight, or when the
version's requests queue downstream (``bundle_per_slot`` unanswered bundles per
execution slot, `slots.SlotCount`; one past ``bundle_deep_per_slot`` requests
per slot): then it collects requests, ``bundle_window_us`` at most. A gateway
with CPU to spare and workers free never makes a request wait; otherwise it
sends fewer, fuller messages, leaving more CPU for the requests themselves.
Details and figures: docs/architecture.md ("Bundles").

Each gateway owns one inbox subscription (``ib.reply.<instance>.*``): reply
bundles arrive on ``<inbox>.b``, nats-server's "no responders" for a bundle
on ``<inbox>.n<first>_<last>`` (its token range); anything else on the inbox
is dropped. The first answer for a token resolves its call; later ones
(redeliveries after a worker crash) are counted and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus_common.bus import body_limit, is_no_responders
from inferbus_common.catalog import Route
from inferbus_common.codec import Tensor
from inferbus_common.errors import (
    DeadlineExceeded,
    InferbusError,
    InvalidArgument,
    Unavailable,
)
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import (
    BundledRequest,
    decode_reply_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.framing import FrameError, parts_size
from inferbus_common.protocol.tensors import tensor_frame_parts
from inferbus_common.subjects import Subjects
from inferbus_gateway.dispatch.calls import (
    Call,
    OpenBundle,
    SentBundle,
    expire_call,
    no_responders_error,
)
from inferbus_gateway.dispatch.cpuload import CpuLoad
from inferbus_gateway.dispatch.fastlane import FastLane
from inferbus_gateway.dispatch.metrics import (
    BUNDLE_REQUESTS,
    CPU_BUSY,
    DUPLICATE_REPLIES,
    HELD_BUNDLES,
    IN_FLIGHT,
    RELEASED_BUNDLES,
    REPLY_BUNDLES,
)
from inferbus_gateway.dispatch.plain import plain_version
from inferbus_gateway.dispatch.reply import Reply
from inferbus_gateway.dispatch.slots import SlotCount

log = logging.getLogger(__name__)

_MAX_SUBJECTS = 1024
"""(model, pinned version) pairs whose subject is kept (beyond it they start over)."""


class Dispatcher:
    """Sends requests into the platform and matches replies to callers.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        instance: this gateway's unique id (names its inbox).
        direct: publish requests on plain routes (`plain_version`) straight to
            the stable version's batchers instead of through the router.
        bundle_window_s: how long a bundle collects requests at most when it waits.
        bundle_max_requests: a bundle is sent once it holds this many requests.
        busy: tells whether CPU is what limits (default: a `CpuLoad` of this
            process, from `bundle_busy_cpu` on).
        bundle_busy_cpu: busy share from which the default `busy` says yes.
        bundle_per_slot: a new bundle on a plain route also collects requests
            while at least this many requests for its version per execution slot
            (`slots`) are in flight here: they queue downstream anyway.
            0: only `busy` makes bundles wait.
        bundle_deep_per_slot: from this many requests per slot in flight here,
            one sent bundle per slot (not `bundle_per_slot`) holds new ones.
        fast_lane: send a lone request on a plain route (a bundle of one, with at
            most `fast_lane_max_in_flight` requests in flight here) to the version's
            idle workers over core NATS (``Subjects.fast``) first; a refusal or no
            responders sends the same bundle the normal way at once.
        fast_lane_retry_s: a fast-lane request with neither an answer nor a worker's
            keep-alive for this long is sent the normal way too (a dead worker);
            the first answer per token wins.
        fast_lane_max_in_flight: the fast lane applies while at most this many
            requests (the new one included) are in flight at this gateway, or at
            most `fast_lane_per_slot` per execution slot of the version (`slots`).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        instance: str,
        *,
        direct: bool = False,
        bundle_window_s: float = 0.006,
        bundle_max_requests: int = 256,
        busy: Callable[[], bool] | None = None,
        bundle_busy_cpu: float = 0.9,
        bundle_per_slot: int = 0,
        bundle_deep_per_slot: int = 0,
        bundle_release_on_reply: bool = True,
        bundle_hold_by: str = "bundles",
        fast_lane: bool = False,
        fast_lane_retry_s: float = 0.5,
        fast_lane_max_in_flight: int = 1,
        fast_lane_per_slot: int = 0,
        slots: Callable[[str, str], int] | None = None,
    ) -> None:
        self._direct = direct
        self._window_s = bundle_window_s
        self._max_requests = bundle_max_requests
        self._load: CpuLoad | None = None
        if busy is None:
            self._load = CpuLoad(high=bundle_busy_cpu, low=bundle_busy_cpu - 0.1)
            load = self._load

            def busy() -> bool:
                return load.saturated

        self._busy = busy
        self._slots = SlotCount(slots) if slots is not None else None
        self._per_slot = bundle_per_slot if self._slots is not None else 0
        self._deep = bundle_deep_per_slot
        self._release_on_reply = bundle_release_on_reply
        self._by_key: dict[str, int] = {}
        """Requests in flight here per subject (sent or in an open bundle)."""
        self._hold_by_bundles = bundle_hold_by == "bundles"
        self._sent_by_key: dict[str, int] = {}
        """Bundles sent per subject with a call still unanswered."""
        self._nc = nc
        self._subjects = subjects
        self._inbox = subjects.reply_inbox(instance)
        self._fast: FastLane[Call] = FastLane(
            nc,
            subjects,
            self._inbox,
            self._resend,
            enabled=fast_lane and direct,
            retry_s=fast_lane_retry_s,
            max_in_flight=fast_lane_max_in_flight,
            per_slot=fast_lane_per_slot,
            slots=self._slots,
        )
        self._bundle_inbox = f"{self._inbox}.b"
        self._pending: dict[int, Call] = {}
        self._next_token = 1
        self._waiting = 0
        self._open: dict[str, OpenBundle] = {}
        self._sends: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None
        self._subject_of: dict[tuple[str, str], tuple[Route | None, str, str]] = {}
        """Per (model, pinned version): (route, subject, version) as `_subject` found
        them, for as long as the route is the catalog's current object."""

    @property
    def load(self) -> CpuLoad | None:
        """The CPU readings this dispatcher bundles by (None: a custom `busy`)."""
        return self._load

    async def start(self) -> None:
        """Subscribe to this instance's inbox (and start the CPU readings)."""
        if self._load is not None:
            self._load.start()
            load = self._load
            CPU_BUSY.set_function(lambda: max(load.machine, load.loop))
        self._sub = await self._nc.subscribe(
            f"{self._inbox}.*",
            cb=self._on_reply,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )

    async def stop(self) -> None:
        """Unsubscribe; callers still waiting get UNAVAILABLE."""
        if self._load is not None:
            self._load.stop()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for bundle in self._open.values():
            if bundle.timer is not None:
                bundle.timer.cancel()
            for call in bundle.calls:
                if not call.fut.done():
                    call.fut.set_exception(Unavailable("gateway is shutting down"))
        self._open.clear()
        self._fast.stop()
        for waiting in self._pending.values():
            if not waiting.fut.done():
                waiting.fut.set_exception(Unavailable("gateway is shutting down"))
        self._pending.clear()
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)

    @property
    def in_flight(self) -> int:
        """Requests waiting for their reply (sent or still in an open bundle)."""
        return self._waiting

    # --- replies ---------------------------------------------------------------
    async def _on_reply(self, msg: Msg) -> None:
        suffix = msg.subject[len(self._inbox) + 1 :]
        if suffix == "b":
            self._on_bundle(msg.data)
            return
        if suffix.startswith("n"):
            self._on_bundle_no_responders(suffix, msg)
            return
        if suffix.startswith("f"):
            self._fast.on_reply(suffix, msg)
            return
        # Nothing else is answered on this inbox: not a reply bundle, not ours.
        log.debug("dropped a message on %s: not a reply bundle", msg.subject)

    def _on_bundle(self, data: bytes) -> None:
        try:
            bundle = decode_reply_bundle(data)
        except FrameError as exc:
            log.warning("dropped an undecodable reply bundle: %s", exc)
            return
        REPLY_BUNDLES.inc()
        shared = h.parse_timings(bundle.timings)
        pending = self._pending
        finished = ""
        for r in bundle.replies:
            waiting = pending.pop(r.token, None)
            if waiting is None or waiting.fut.done():
                DUPLICATE_REPLIES.inc()
                continue
            if self._settle(waiting):
                finished = waiting.key
            timings = {"queue": r.queue_ms, **shared} if bundle.batch_rows else dict(shared)
            waiting.fut.set_result(
                Reply(
                    r.status,
                    r.error,
                    r.reason,
                    bundle.version,
                    bundle.digest,
                    timings,
                    r.frame,
                )
            )

        # A sent bundle fully answered means an execution slot of that subject's
        # version finished a batch: a bundle held because the version's slots had
        # their bundles goes now, so the next batch is on its way while this reply
        # is read; the window only caps the wait when no reply comes. Not while CPU
        # is short: then fuller bundles (fewer messages) are what helps, and the
        # window fills them. With none of this gateway's bundles left there, a
        # worker is free: the bundle may take the fast lane.
        if finished and self._release_on_reply and not self._busy():
            held = self._open.get(finished)
            if held is not None and held.timer is not None:
                RELEASED_BUNDLES.inc()
                slots = self._slot_count(held.model, held.version)
                idle = self._sent_by_key.get(finished, 0) < max(1, slots)
                self._flush(finished, held, released=idle)

    def _on_bundle_no_responders(self, suffix: str, msg: Msg) -> None:
        """nats-server's "no responders" for a bundle: fail its still-waiting calls now."""
        if not is_no_responders(msg):
            return
        try:
            first, last = (int(x) for x in suffix[1:].split("_", 1))
        except ValueError:
            return
        exc = no_responders_error(msg)
        for token in range(first, last + 1):
            waiting = self._pending.pop(token, None)
            if waiting is not None and not waiting.fut.done():
                waiting.fut.set_exception(exc)

    def fail_pending(
        self, model: str, version: str, before_ns: int | None, error: InferbusError
    ) -> int:
        """Answer `error` to the sent requests for `model` pinned to `version` that
        wait for their reply, those whose deadline is before `before_ns` (None:
        all). For a version that lost its last worker (`noworker.WorkerWatch`);
        O(requests waiting), run a few times per lost version, never per request.
        Requests the router chooses a version for (a stable/canary split) are not
        pinned here and wait for their deadline.

        Returns:
            How many were answered.
        """
        hit = [
            token
            for token, waiting in self._pending.items()
            if waiting.request.envelope.version == version
            and waiting.request.envelope.model == model
            and (before_ns is None or waiting.request.envelope.deadline_ns < before_ns)
        ]
        for token in hit:
            waiting = self._pending.pop(token)
            if not waiting.fut.done():
                waiting.fut.set_exception(error)
        return len(hit)

    def _resend(self, subject: str, payload: bytes, reply: str, calls: list[Call]) -> None:
        """Send a bundle (a fast-lane request's fallback) from outside a coroutine."""
        task = asyncio.ensure_future(self._send(subject, payload, reply, calls))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    # --- requests --------------------------------------------------------------
    async def call(
        self,
        envelope: Envelope,
        tensors: list[Tensor],
        *,
        route: Route | None = None,
        window_s: float | None = None,
        max_rows: int = 0,
    ) -> Reply:
        """Send a request and wait for its reply until ``envelope.deadline_ns``.

        The request goes in a request bundle (alone, or with others for the
        same subject). `route` is the model's routing table as the gateway
        knows it; with ``direct`` on and a plain route the request skips the
        router. `window_s` caps how long the request may wait in an open bundle
        (below the dispatcher's own cap); a bundle goes as soon as its rows
        reach `max_rows` (the model's ``max_batch_size``; 0: no such bound).

        Raises:
            InvalidArgument: the tensors do not fit in one bus message.
            DeadlineExceeded: no reply before the deadline.
            Unavailable: nobody serves the model's subject right now.
        """
        model = envelope.model
        hit = self._subject_of.get((model, envelope.version))
        if hit is not None and hit[0] is route:
            subject, version = hit[1], hit[2]
        else:
            subject, version = self._subject(model, envelope.version, route)
        loop = asyncio.get_running_loop()
        parts = tensor_frame_parts(tensors)
        size = parts_size(parts)
        limit = body_limit(self._nc)
        if size > limit:
            raise InvalidArgument(
                f"the request's tensors take {size} bytes, more than the {limit} bytes a "
                "message on the platform's bus may carry (nats-server max_payload); send "
                "fewer rows per request"
            )
        call = Call(loop.create_future(), BundledRequest(envelope), parts, subject, size)
        rows = tensors[0].shape[0] if tensors and tensors[0].shape else 1
        lead = self._enqueue(call, model, version, rows, max_rows, window_s)
        timer = None
        try:
            if lead is not None:
                # This call opened the bundle: whatever arrives in this loop turn
                # joins it, then this call sends it (no task, no extra loop hop).
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    self._flush(key=call.key, bundle=lead)
                    raise
                out = self._prepare(call.key, lead)
                if out is not None:
                    await self._send(*out)
            remaining = h.remaining_s(envelope.deadline_ns)
            if remaining <= 0:
                raise TimeoutError
            # A timer on the reply's own future instead of `asyncio.wait_for`: the
            # same deadline without wait_for's extra waiter future and loop hop.
            timer = loop.call_later(remaining, expire_call, call.fut)
            return await call.fut
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {envelope.request_id} for model '{model}' got no answer before "
                "its deadline"
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            self._done(call)

    def _subject(self, model: str, pinned: str, route: Route | None) -> tuple[str, str]:
        """The subject a request for (`model`, `pinned`) goes to, and the version when
        it skips the router ('' when it goes through it); kept per (model, pinned)
        while `route` is the catalog's current route object (a change replaces it)."""
        version = plain_version(route, pinned) if self._direct else ""
        subject = self._subjects.infer(model, version) if version else ""
        if not subject:
            subject = self._subjects.route(model)
        if len(self._subject_of) >= _MAX_SUBJECTS:
            self._subject_of.clear()
        self._subject_of[(model, pinned)] = (route, subject, version)
        return subject, version

    def _enqueue(
        self,
        call: Call,
        model: str,
        version: str,
        rows: int,
        max_rows: int,
        window_s: float | None,
    ) -> OpenBundle | None:
        """Put `call` into its subject's open bundle (opening one), send what is due.

        Returns the bundle when `call` opened it and is to send it itself at the
        end of this loop turn (few requests wait at this gateway), else None.
        """
        key = call.key
        size = call.size
        bundle = self._open.get(key)
        if bundle is not None and (
            bundle.nbytes + size > body_limit(self._nc) or len(bundle.calls) >= self._max_requests
        ):
            self._flush(key)
            bundle = None
        lead = None
        if bundle is None:
            bundle = self._open[key] = OpenBundle(key, model, version, max_rows=max_rows)
            if not self._waiting or not (self._busy() or self._queued(key, model, version)):
                # CPU to spare and workers free (or nothing else in flight): what
                # arrives in this loop turn joins; this call sends it.
                lead = bundle
            else:
                # Short of CPU, or the version's requests queue downstream: they
                # wait anyway; collect a while.
                HELD_BUNDLES.inc()
                window = self._window_s if window_s is None else min(window_s, self._window_s)
                bundle.timer = asyncio.get_running_loop().call_later(window, self._flush, key)
        call.opened_ns = time.monotonic_ns()
        bundle.calls.append(call)
        self._by_key[key] = self._by_key.get(key, 0) + 1
        self._waiting += 1
        IN_FLIGHT.value = self._waiting
        bundle.nbytes += size
        bundle.rows += rows
        if (bundle.max_rows and bundle.rows >= bundle.max_rows) or len(
            bundle.calls
        ) >= self._max_requests:
            self._flush(key)
            return None
        return lead

    def _queued(self, key: str, model: str, version: str) -> bool:
        """Whether `version`'s execution slots have their share of this gateway's work
        for `key` (plain routes only: a known version): `bundle_per_slot` sent bundles
        per slot still unanswered (one running, one on the wire; one from
        `bundle_deep_per_slot` requests per slot in flight here on), or with
        ``bundle_hold_by="requests"`` that many requests per slot in flight."""
        if not self._per_slot:
            return False
        slots = self._slot_count(model, version)
        if not self._hold_by_bundles:
            return 0 < slots * self._per_slot <= self._by_key.get(key, 0)
        per_slot = self._per_slot
        if self._deep and self._by_key.get(key, 0) >= self._deep * slots:
            per_slot = 1
        return 0 < slots * per_slot <= self._sent_by_key.get(key, 0)

    def _slot_count(self, model: str, version: str) -> int:
        """Execution slots of `version` (0: unknown, as for a route's alias)."""
        return self._slots(model, version) if self._slots and version else 0

    def _settle(self, call: Call) -> bool:
        """Count `call` as answered in its sent bundle; True when that was the
        bundle's last unanswered call."""
        sent = call.sent
        if sent is None:
            return False
        call.sent = None
        sent.left -= 1
        if sent.left:
            return False
        left = self._sent_by_key[sent.key] - 1
        if left:
            self._sent_by_key[sent.key] = left
        else:
            del self._sent_by_key[sent.key]
        return True

    def _flush(self, key: str, bundle: OpenBundle | None = None, *, released: bool = False) -> None:
        """Send the open bundle of `key` (only if it is `bundle`, when given) in a task;
        `released`: a held bundle sent because this gateway's last bundle at its version
        was answered, so a slot is free (it may take the fast lane, `FastLane.route`)."""
        out = self._prepare(key, bundle, released=released)
        if out is None:
            return
        task = asyncio.ensure_future(self._send(*out))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _prepare(
        self, key: str, bundle: OpenBundle | None = None, *, released: bool = False
    ) -> tuple[str, bytes, str, list[Call]] | None:
        """Close the open bundle of `key`: tokens for its calls, its message.

        Returns (subject, payload, no-responders reply subject, calls), or None
        when there is nothing to send (no open bundle, not `bundle`, or every
        call in it already ended).
        """
        current = self._open.get(key)
        if current is None or (bundle is not None and current is not bundle):
            return None
        del self._open[key]
        bundle = current
        if bundle.timer is not None:
            bundle.timer.cancel()
        calls = [c for c in bundle.calls if not c.fut.done()]
        if not calls:
            return None
        first = self._next_token
        self._next_token += len(calls)
        now = time.monotonic_ns()
        sent = SentBundle(key, len(calls))
        self._sent_by_key[key] = self._sent_by_key.get(key, 0) + 1
        for i, call in enumerate(calls):
            call.sent = sent
            call.token = call.request.token = first + i
            # Time spent filling this bundle counts against the model's batching delay.
            call.request.held_ns = now - call.opened_ns
            self._pending[call.token] = call
        BUNDLE_REQUESTS.observe(len(calls))
        try:
            payload = encode_request_bundle(
                bundle.model,
                bundle.version,
                self._bundle_inbox,
                [c.request for c in calls],
                [c.parts for c in calls],
            )
        except (FrameError, InferbusError) as exc:
            for call in calls:
                if not call.fut.done():
                    call.fut.set_exception(exc)
            return None
        # nats-server's "no responders" names the bundle's token range.
        reply = f"{self._inbox}.n{first}_{first + len(calls) - 1}"
        # A lone request on a plain route: to an idle worker first.
        lane = self._fast.route(
            bundle.subject,
            bundle.model,
            bundle.version,
            payload,
            reply,
            calls,
            first,
            self._waiting,
            released,
        )
        if lane is not None:
            return lane
        return bundle.subject, payload, reply, calls

    async def _send(self, subject: str, payload: bytes, reply: str, calls: list[Call]) -> None:
        try:
            await self._nc.publish(subject, payload, reply=reply)
        except Exception as exc:  # every caller still gets exactly one answer
            log.warning("could not send a request bundle: %s", exc)
            err = Unavailable(f"the gateway could not send the request: {type(exc).__name__}")
            for call in calls:
                if not call.fut.done():
                    call.fut.set_exception(err)

    def _done(self, call: Call) -> None:
        """A call ended (answered, timed out or cancelled): forget its token."""
        self._settle(call)
        self._waiting -= 1
        IN_FLIGHT.value = self._waiting
        left = self._by_key[call.key] - 1
        if left:
            self._by_key[call.key] = left
        else:
            del self._by_key[call.key]
        if call.token:
            self._pending.pop(call.token, None)
            self._fast.forget(call.token)
