"""Shadow traffic: sampled copies to a shadow version, compared with the primary.

For a sampled request the router sends it twice (``<inbox>`` =
``ib.reply.<router instance>.shadow``):

* the **primary** copy, in the bundle to the version it was routed to, exactly
  as without shadowing, plus a mirror: inbox ``<inbox>.pb`` and the pair's
  token. The worker that answers it puts the same reply in a reply bundle
  there too, so the client's path neither changes nor waits;
* the **shadow** copy, in a bundle to ``ib.infer.<model>.<shadow>`` whose inbox
  is ``<inbox>.sb``, an inbox this router owns: shadow replies can never reach
  a client.

`ShadowComparer` pairs the two replies by token in a table bounded in size
and in time (`max_pending`, `timeout_s`): a request whose pair does not
complete in time is counted (``shadow_timeout`` / ``primary_missing``) and
forgotten. Comparison decodes the two reply bodies (off the request path,
only for sampled requests): argmax agreement per row for classification
outputs, the largest absolute difference for any numeric output, and the
latency difference seen at the router. Everything here is counted, never
raised: the shadow path cannot fail a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Gauge, Histogram

from inferbus_common.codec import Buffer
from inferbus_common.protocol.bundles import decode_reply_bundle
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

_LABELS = ["model", "primary", "shadow"]
SHADOW_REQUESTS = Counter(
    "inferbus_shadow_requests_total",
    "Shadowed requests by outcome: compared, shadow_error, primary_error, shadow_timeout, "
    "primary_missing, incomparable, dropped (pairing table full).",
    [*_LABELS, "outcome"],
)
SHADOW_ROWS = Counter(
    "inferbus_shadow_rows_total",
    "Rows of classification outputs compared, by result (agree: same argmax).",
    [*_LABELS, "result"],
)
SHADOW_AGREEMENT = Gauge(
    "inferbus_shadow_agreement_ratio",
    "Share of compared classification rows on which shadow and primary agree (argmax).",
    _LABELS,
)
SHADOW_ABS_DIFF = Histogram(
    "inferbus_shadow_abs_diff",
    "Largest absolute difference between shadow and primary outputs, per request.",
    _LABELS,
    buckets=(0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 1.0, 10.0, float("inf")),
)
SHADOW_LATENCY_DIFF = Histogram(
    "inferbus_shadow_latency_diff_ms",
    "Shadow reply time minus primary reply time, as seen by the router, in ms.",
    _LABELS,
    buckets=(-1000, -250, -100, -50, -20, -10, -5, -2, -1, 0, 1, 2, 5, 10, 20, 50, 100, 250, 1000),
)
SHADOW_PENDING = Gauge(
    "inferbus_shadow_pending", "Shadowed requests waiting for their pair of replies."
)


class Incomparable(ValueError):
    """The two replies cannot be compared (different outputs, shapes or types)."""


@dataclass(frozen=True, slots=True)
class Comparison:
    """What one shadow/primary pair of replies showed.

    Attributes:
        rows: classification rows compared (0 when no output is a classification).
        agree: rows whose argmax is the same.
        max_abs_diff: largest absolute difference over all numeric outputs
            (None when no output is numeric).
    """

    rows: int
    agree: int
    max_abs_diff: float | None


def compare_replies(primary: Buffer, shadow: Buffer) -> Comparison:
    """Compare two OK reply bodies (tensor frames).

    A classification output is a 2-D numeric tensor with at least two columns
    (rows × classes); the first one in the primary's order is scored by argmax.

    Raises:
        Incomparable: the outputs differ in names, shapes or kinds, or a body
            is not a tensor frame.
    """
    try:
        a = {t.name: t.as_numpy() for t in decode_tensors(primary)}
        b = {t.name: t.as_numpy() for t in decode_tensors(shadow)}
    except (FrameError, ValueError) as exc:
        raise Incomparable(f"undecodable reply: {exc}") from None
    if a.keys() != b.keys():
        raise Incomparable(f"outputs differ: {sorted(a)} vs {sorted(b)}")
    rows = agree = 0
    diff: float | None = None
    classified = False
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            raise Incomparable(f"output '{name}' shape {x.shape} vs {y.shape}")
        numeric = np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)
        if not numeric:
            continue
        if x.size:
            d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            diff = d if diff is None else max(diff, d)
        if not classified and x.ndim == 2 and x.shape[1] >= 2:
            classified = True
            rows = x.shape[0]
            agree = int(np.count_nonzero(np.argmax(x, axis=1) == np.argmax(y, axis=1)))
    return Comparison(rows, agree, diff)


@dataclass(slots=True)
class _Pending:
    model: str
    primary: str
    shadow: str
    request_id: str
    sent: float
    """Monotonic time both copies were published."""
    primary_reply: tuple[bool, Buffer] | None = None
    """(OK?, body) of the primary's reply, once it came."""
    primary_at: float = 0.0
    shadow_reply: tuple[bool, Buffer] | None = None
    shadow_at: float = 0.0


class ShadowComparer:
    """Owns the router's compare inbox and the table pairing replies.

    Args:
        nc: connected NATS client.
        subjects: naming scheme.
        instance: this router's id (names its inbox, so instances never mix).
        timeout_s: how long to wait for both replies of a pair.
        max_pending: pairs in flight at most; beyond it new samples are dropped.
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        instance: str,
        *,
        timeout_s: float = 10.0,
        max_pending: int = 10_000,
    ) -> None:
        self._nc = nc
        self.inbox = subjects.shadow_inbox(instance)
        self._timeout = timeout_s
        self._max_pending = max_pending
        self._pending: dict[int, _Pending] = {}
        self._tokens = itertools.count(1)
        self._sub: Subscription | None = None
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._agree: dict[tuple[str, str, str], list[int]] = {}

    @property
    def pending(self) -> int:
        """Pairs waiting for replies."""
        return len(self._pending)

    async def start(self) -> None:
        """Subscribe to the compare inbox and start expiring stale pairs."""
        self._sub = await self._nc.subscribe(
            f"{self.inbox}.*",
            cb=self._on_bundle,
            pending_msgs_limit=100_000,
            pending_bytes_limit=256 << 20,
        )
        self._stop.clear()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="shadow-sweeper")

    async def stop(self) -> None:
        """Unsubscribe and stop the sweeper; pairs still open are counted as timed out."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        self._sub = None
        self._stop.set()
        if self._sweeper is not None:
            await self._sweeper
            self._sweeper = None
        self._expire(float("inf"))

    def begin(
        self, model: str, primary: str, shadow: str, request_id: str
    ) -> tuple[str, str, int] | None:
        """Open a pair; returns (mirror inbox for the primary, inbox of the shadow
        copy's bundle, the pair's token), or None when the table is full (counted
        as dropped)."""
        now = time.monotonic()
        self._expire(now - self._timeout)
        if len(self._pending) >= self._max_pending:
            SHADOW_REQUESTS.labels(model, primary, shadow, "dropped").inc()
            return None
        token = next(self._tokens)
        self._pending[token] = _Pending(model, primary, shadow, request_id, now)
        SHADOW_PENDING.set(len(self._pending))
        return f"{self.inbox}.pb", f"{self.inbox}.sb", token

    def cancel(self, token: int) -> None:
        """Forget a pair whose shadow copy could not be published."""
        self._pending.pop(token, None)
        SHADOW_PENDING.set(len(self._pending))

    async def _on_bundle(self, msg: Msg) -> None:
        kind = msg.subject[len(self.inbox) + 1 :]
        if kind not in ("pb", "sb"):
            return
        try:
            bundle = decode_reply_bundle(msg.data)
        except FrameError as exc:
            log.info("undecodable shadow reply bundle: %s", exc)
            return
        for r in bundle.replies:
            self._got(kind[0], r.token, not r.status, r.frame)

    def _got(self, kind: str, token: int, ok: bool, body: Buffer) -> None:
        p = self._pending.get(token)
        if p is None:
            return  # late (already expired) or a redelivered duplicate
        now = time.monotonic()
        if kind == "p" and p.primary_reply is None:
            p.primary_reply, p.primary_at = (ok, body), now
        elif kind == "s" and p.shadow_reply is None:
            p.shadow_reply, p.shadow_at = (ok, body), now
        else:
            return
        if p.primary_reply is not None and p.shadow_reply is not None:
            del self._pending[token]
            SHADOW_PENDING.set(len(self._pending))
            self._finish(p)

    def _finish(self, p: _Pending) -> None:
        assert p.primary_reply is not None and p.shadow_reply is not None
        labels = (p.model, p.primary, p.shadow)
        if not p.primary_reply[0]:
            SHADOW_REQUESTS.labels(*labels, "primary_error").inc()
            return
        if not p.shadow_reply[0]:
            SHADOW_REQUESTS.labels(*labels, "shadow_error").inc()
            return
        SHADOW_LATENCY_DIFF.labels(*labels).observe((p.shadow_at - p.primary_at) * 1000)
        try:
            result = compare_replies(p.primary_reply[1], p.shadow_reply[1])
        except Incomparable as exc:
            SHADOW_REQUESTS.labels(*labels, "incomparable").inc()
            log.info("shadow reply not comparable: %s", exc, extra={"request_id": p.request_id})
            return
        SHADOW_REQUESTS.labels(*labels, "compared").inc()
        if result.max_abs_diff is not None:
            SHADOW_ABS_DIFF.labels(*labels).observe(result.max_abs_diff)
        if result.rows:
            SHADOW_ROWS.labels(*labels, "agree").inc(result.agree)
            SHADOW_ROWS.labels(*labels, "disagree").inc(result.rows - result.agree)
            totals = self._agree.setdefault(labels, [0, 0])
            totals[0] += result.agree
            totals[1] += result.rows
            SHADOW_AGREEMENT.labels(*labels).set(totals[0] / totals[1])

    def _expire(self, cutoff: float) -> None:
        # Insertion order is send order, so the stale pairs are at the front.
        expired = []
        for token, p in self._pending.items():
            if p.sent > cutoff:
                break
            expired.append(token)
        for token in expired:
            p = self._pending.pop(token)
            outcome = "primary_missing" if p.primary_reply is None else "shadow_timeout"
            SHADOW_REQUESTS.labels(p.model, p.primary, p.shadow, outcome).inc()
        if expired:
            SHADOW_PENDING.set(len(self._pending))

    async def _sweep_loop(self) -> None:
        interval = max(0.05, self._timeout / 4)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)
            self._expire(time.monotonic() - self._timeout)
