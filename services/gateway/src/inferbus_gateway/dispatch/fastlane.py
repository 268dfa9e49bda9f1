"""The gateway's side of the fast lane: requests straight to an idle worker.

A lone request on a plain route (a bundle of one, with at most
`max_in_flight` requests in flight at the gateway) goes as its unchanged
request bundle over core NATS to ``Subjects.fast(model, version)``, the queue
group of the version's workers (`inferbus_worker.fastlane`), with
``<inbox>.f<token>`` as reply subject. A worker with a free slot answers it
through the normal reply bundle; a busy one answers ``busy`` there, and a
running one sends empty keep-alives. The request is sent the normal way
(batcher, JetStream) on ``busy``, on nats-server's "no responders", or after
`retry_s` without an answer or a keep-alive (a dead worker); the first answer
per token wins (`Dispatcher` drops later ones as duplicates). A bundle of
several requests takes the lane too when the dispatcher released it because a
reply bundle of its subject came back (an execution slot just finished): the
worker runs it as one micro-batch, or answers ``busy`` when it cannot.

When nats-server refuses the gateway's publishes on ``<prefix>.fast.>`` (a
NATS permissions file from before the lane), every lane request would wait
`retry_s` for its fallback: the lane is switched off for the process at the
first refusal, with an ERROR log line and ``inferbus_gateway_fast_lane_enabled``
0, and what is on it is sent the normal way at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import Gauge

from inferbus_common.bus import is_no_responders, is_publish_violation, on_error
from inferbus_common.loopmetrics import LoopCounter
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

FAST_LANE_SENT = LoopCounter(
    "inferbus_gateway_fast_lane_sent_total",
    "Lone requests sent on the fast lane (straight to an idle worker over core NATS).",
)
FAST_LANE_FALLBACKS = LoopCounter(
    "inferbus_gateway_fast_lane_fallbacks_total",
    "Fast-lane requests sent again the normal way (worker busy, no worker subscribed, "
    "or no answer nor keep-alive within fast_lane_retry_s).",
)
FAST_LANE_ENABLED = Gauge(
    "inferbus_gateway_fast_lane_enabled",
    "1 while this gateway sends lone requests on the fast lane; 0 when it is off by "
    "setting or switched off because nats-server refused its publishes there "
    "(a NATS permissions file from before the fast lane: regenerate it).",
)


class _Waiter(Protocol):
    @property
    def fut(self) -> asyncio.Future[Any]: ...


C = TypeVar("C", bound=_Waiter)

Send = Callable[[str, bytes, str, list[C]], None]
"""Sends a bundle the normal way: (subject, payload, reply subject, calls)."""


class FastLane(Generic[C]):
    """The lane requests of one dispatcher, and their fallbacks (see module docstring).

    Args:
        nc: the dispatcher's connection (its asynchronous errors are watched).
        subjects: naming scheme.
        inbox: the dispatcher's reply inbox.
        resend: sends a bundle the normal way.
        enabled: whether the lane is used at all.
        retry_s: how long a lane request may go without an answer or keep-alive.
        max_in_flight: the lane applies while at most this many requests (the new
            one included) are in flight at the gateway, or
        per_slot: ... while at most this many per execution slot of the version
            (`slots`: its ready workers' ``instance_count`` summed); two per slot
            keep each slot busy (one running, one on the wire) without piling up
            refusals (A/B in bench/findings.md, round 11).
        slots: the version's execution slots as the catalog knows them now
            (cheap: called per lone request; `slots.SlotCount` caches it).
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        inbox: str,
        resend: Send[C],
        *,
        enabled: bool,
        retry_s: float,
        max_in_flight: int,
        per_slot: int = 0,
        slots: Callable[[str, str], int] | None = None,
    ) -> None:
        self._per_slot = per_slot if slots is not None else 0
        self._slots = slots
        self._subjects = subjects
        self._inbox = inbox
        self._resend = resend
        self.enabled = enabled
        self._retry_s = retry_s
        self._max = max_in_flight
        self._held: dict[int, tuple[str, bytes, str, list[C], asyncio.TimerHandle]] = {}
        """Per token of a lane request: its normal (subject, payload, reply, calls)
        and its retry timer."""
        FAST_LANE_ENABLED.set(1 if enabled else 0)
        if enabled:
            on_error(nc, self._on_nats_error)

    def route(
        self,
        subject: str,
        model: str,
        version: str,
        payload: bytes,
        reply: str,
        calls: list[C],
        first: int,
        in_flight: int,
        released: bool = False,
    ) -> tuple[str, bytes, str, list[C]] | None:
        """Where a bundle goes when it takes the lane (None: the normal way).

        A lone request takes it within `max_in_flight` / `per_slot`; a bundle of
        several only when `released`: it was held until a reply bundle said an
        execution slot of its version had just finished, so a worker is free now.
        """
        if not self.enabled or not version:
            return None
        if len(calls) > 1:
            if not released:
                return None
        elif in_flight > self._max and in_flight > self._limit(model, version):
            return None
        timer = asyncio.get_running_loop().call_later(self._retry_s, self._fallback, first)
        self._held[first] = (subject, payload, reply, calls, timer)
        FAST_LANE_SENT.inc()
        return self._subjects.fast(model, version), payload, f"{self._inbox}.f{first}", calls

    def _limit(self, model: str, version: str) -> int:
        """How many requests may be in flight here for a lone one to take the lane."""
        if not self._per_slot or self._slots is None:
            return self._max
        return self._per_slot * self._slots(model, version)

    def on_reply(self, suffix: str, msg: Msg) -> None:
        """A lane request's reply subject (``f<token>``): a worker's keep-alive (empty)
        extends its retry time; a refusal or "no responders" sends it the normal way now."""
        try:
            token = int(suffix[1:])
        except ValueError:
            return
        entry = self._held.get(token)
        if entry is None:
            return
        if not is_no_responders(msg) and not msg.data:
            subject, payload, reply, calls, timer = entry
            timer.cancel()
            timer = asyncio.get_running_loop().call_later(self._retry_s, self._fallback, token)
            self._held[token] = (subject, payload, reply, calls, timer)
            return
        self._fallback(token)

    def forget(self, token: int) -> None:
        """A call ended: once every call of its lane bundle (held under the bundle's
        first token) has, nothing is left to fall back for."""
        if self._held:
            entry = self._held.get(token)
            if entry is not None and all(c.fut.done() for c in entry[3]):
                del self._held[token]
                entry[4].cancel()

    def stop(self) -> None:
        for *_, timer in self._held.values():
            timer.cancel()
        self._held.clear()

    def _fallback(self, token: int) -> None:
        """Send a lane request's bundle the normal way (same tokens: whichever answer
        comes first is kept, a later one is dropped as a duplicate)."""
        entry = self._held.pop(token, None)
        if entry is None:
            return
        subject, payload, reply, calls, timer = entry
        timer.cancel()
        calls = [c for c in calls if not c.fut.done()]
        if not calls:
            return
        FAST_LANE_FALLBACKS.inc()
        self._resend(subject, payload, reply, calls)

    def _on_nats_error(self, exc: Exception) -> None:
        """nats-server refused a lane publish: switch the lane off (module docstring)."""
        if not self.enabled or not is_publish_violation(exc, f"{self._subjects.prefix}.fast."):
            return
        self.enabled = False
        FAST_LANE_ENABLED.set(0)
        log.error(
            "nats-server refuses this gateway's publishes on %s.fast.> (%s): the fast "
            "lane is off for this process; regenerate the NATS permissions "
            "(inferbus_common.security, docs/security.md) to use it",
            self._subjects.prefix,
            exc,
        )
        for token in list(self._held):
            self._fallback(token)
