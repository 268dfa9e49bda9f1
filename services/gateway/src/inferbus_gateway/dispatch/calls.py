"""What the dispatcher keeps per call and per bundle, and two of its small rules.

`Call`: a request waiting in an open bundle, then for its reply. `OpenBundle`: an
open bundle of one subject. `SentBundle`: a sent bundle, counted until its last call
is settled (the per-slot hold rule counts these; `Dispatcher._queued`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from inferbus_common.codec import Buffer
from inferbus_common.errors import Unavailable
from inferbus_common.protocol.bundles import BundledRequest
from inferbus_gateway.dispatch.reply import Reply

_NATS_SUBJECT = "Nats-Subject"


def expire_call(fut: asyncio.Future[Reply]) -> None:
    """The deadline passed before the reply: wake the caller with a timeout."""
    if not fut.done():
        fut.set_exception(TimeoutError())


@dataclass(slots=True, eq=False)
class Call:
    """A request waiting in an open bundle, then for its reply."""

    fut: asyncio.Future[Reply]
    request: BundledRequest
    """The request as it goes into the bundle (its envelope, token, held time, frame)."""
    parts: list[Buffer]
    key: str
    size: int = 0
    token: int = 0
    opened_ns: int = 0
    """Monotonic time the call joined its bundle."""
    sent: SentBundle | None = None
    """The bundle it went in, until the call is settled (answered or ended)."""


@dataclass(slots=True, eq=False)
class SentBundle:
    """A sent bundle of one subject, counted until its last call is settled."""

    key: str
    left: int


@dataclass(slots=True, eq=False)
class OpenBundle:
    """Requests for one subject collected during a window."""

    subject: str
    model: str
    version: str
    calls: list[Call] = field(default_factory=list)
    nbytes: int = 0
    rows: int = 0
    max_rows: int = 0
    timer: asyncio.Handle | None = None


def no_responders_error(msg: Msg) -> Unavailable:
    """The error for nats-server's "no responders" on a request's subject."""
    # Nobody subscribes to the route subject (every router is down or
    # restarting), or, for a direct request, to the version's subject (no
    # batcher). Nothing was computed: say so now instead of waiting out the deadline.
    where = (msg.headers or {}).get(_NATS_SUBJECT, "")
    if ".infer." in where:
        return Unavailable(
            "no batcher is serving this model version right now (restarting?); "
            "nothing was computed, safe to retry"
        )
    return Unavailable(
        "no router is serving requests right now (restarting?); nothing was computed, safe to retry"
    )
