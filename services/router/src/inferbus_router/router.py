"""The router component: subscribe to `ib.route.*`, forward to `ib.infer.<model>.<version>`.

Two kinds of request arrive, each on its own subject in its one framing:

* tensor requests on ``ib.route.<model>``, always in request bundles (a lone
  request is a bundle of one): per request, decide the version (`inferbus_common.resolver.decide`:
  pinned → sticky → weighted, with the canary weight scaled by `health.HealthWeights`); the
  bundle is split by decided version into one bundle per version on
  ``ib.infer.…`` (frames passed through untouched), a sampled share's shadow
  copies into one bundle to the shadow version (`shadow.ShadowComparer`);
* generative requests on ``ib.genroute.<model>`` (headers, OpenAI JSON body),
  forwarded whole to ``ib.gen.…`` of the decided version, or to the one
  worker of it holding the prompt's prefix (`prefix.PlacedForwarder`).

Anything else (a tensor request in the headers-and-frame form of old
gateways, garbage) is refused: INVALID_ARGUMENT to its reply subject when it
names one, else counted and dropped. Alongside: follow route revisions (log
each change once, export the revision) and feed audit records to the health
windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Gauge, Histogram

from inferbus_common import tracing
from inferbus_common.bus import is_no_responders, leave, sync
from inferbus_common.catalog import Catalog, Route
from inferbus_common.errors import (
    InferbusError,
    InvalidArgument,
    StatusCode,
    status_of,
)
from inferbus_common.generation import no_generation_worker
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import (
    BundledRequest,
    RequestBundle,
    decode_request_bundle,
    encode_request_bundle,
)
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.replies import ReplyTarget, send_error, send_errors
from inferbus_common.resolver import decide, stickiness_key, wants_shadow
from inferbus_common.subjects import Subjects, name_from_token, subject_token
from inferbus_router.health import HealthWeights
from inferbus_router.prefix import PlacedForwarder
from inferbus_router.shadow import ShadowComparer

log = logging.getLogger(__name__)

_NR_TOKENS = 64
"""Most requests of one forwarded bundle: their tokens ride in its reply subject."""

ROUTE_SPAN = "inferbus.router.route"
ROUTE_SECONDS = Histogram(
    "inferbus_router_route_seconds",
    "Time the router spends on a request (routing decision and republish).",
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.1),
)

ROUTED = Counter(
    "inferbus_router_requests_total",
    "Requests handled by the router, by model, chosen version and outcome.",
    ["model", "version", "status"],
)
DECISIONS = Counter(
    "inferbus_router_decisions_total",
    "Routing decisions by model, version and reason (pinned, sticky, weighted, stable).",
    ["model", "version", "reason"],
)
ROUTE_REVISION = Gauge(
    "inferbus_router_route_revision",
    "Revision of each model's routing table this router follows.",
    ["model"],
)


class Router:
    """Forwards requests to the version the routing table picks.

    Args:
        nc: connected NATS client.
        catalog: live catalog (routes are read from it).
        subjects: naming scheme.
        queue_group: NATS queue group shared by router instances.
        health: health-aware canary scaling (None: configured weights as they are).
        shadow: shadow comparer (None: no shadow copies are sent).
        health_interval_s: how often the health factors are re-evaluated.
        draw: uniform [0, 1) source of the weighted choice and shadow sampling.
        placement: prefix-aware placement of generative requests on a version's
            workers (None: the version's queue group takes every one).
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        subjects: Subjects,
        queue_group: str,
        *,
        health: HealthWeights | None = None,
        shadow: ShadowComparer | None = None,
        health_interval_s: float = 2.0,
        draw: Callable[[], float] = random.random,
        placement: PlacedForwarder | None = None,
    ) -> None:
        self._nc = nc
        self._catalog = catalog
        self._subjects = subjects
        self._queue_group = queue_group
        self._health = health
        self._shadow = shadow
        self._health_interval = health_interval_s
        self._draw = draw
        self._placement = placement
        self._sub: Subscription | None = None
        self._gen_sub: Subscription | None = None
        self._audit_sub: Subscription | None = None
        # Where nats-server's "no responders" comes back when nobody is subscribed
        # to a version's subject. For generative requests:
        # ``<inbox>.<model>.<version>.<client reply>`` (subject tokens), so the
        # answer can tell "all workers full" from "none".
        instance = f"router-{uuid.uuid4().hex[:12]}"
        self._nr_gen_inbox = subjects.reply_inbox(f"{instance}-gen")
        self._nr_gen_sub: Subscription | None = None
        # For request bundles (no batcher): ``<inbox>.<tokens>.<gateway inbox>``.
        self._nr_bundle_inbox = subjects.reply_inbox(f"{instance}-b")
        self._nr_bundle_sub: Subscription | None = None
        self._revisions: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start following the routes and audit records, then take requests."""
        self._stop.clear()
        self._note_revisions()
        self._tasks.append(asyncio.create_task(self._follow_routes(), name="router-routes"))
        if self._shadow is not None:
            await self._shadow.start()
        if self._health is not None:
            # One token after `audit`: the records, not payload captures
            # (`<prefix>.audit.payload.<model>.<version>`).
            self._audit_sub = await self._nc.subscribe(
                f"{self._subjects.prefix}.audit.*",
                cb=self._on_audit,
                pending_msgs_limit=100_000,
                pending_bytes_limit=64 << 20,
            )
            self._health.evaluate(self._catalog.routes)
            self._tasks.append(asyncio.create_task(self._health_loop(), name="router-health"))
        self._nr_bundle_sub = await self._nc.subscribe(
            f"{self._nr_bundle_inbox}.>", cb=self._on_no_bundle_responders
        )
        self._nr_gen_sub = await self._nc.subscribe(
            f"{self._nr_gen_inbox}.>", cb=self._on_no_gen_responders
        )
        if self._placement is not None:
            await self._placement.start()
        self._sub = await self._nc.subscribe(
            self._subjects.route_all,
            queue=self._queue_group,
            cb=self._on_request_observed,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )
        self._gen_sub = await self._nc.subscribe(
            self._subjects.gen_route_all,
            queue=self._queue_group,
            cb=self._on_generate_observed,
            pending_msgs_limit=100_000,
            pending_bytes_limit=256 << 20,
        )
        # Round trips: nats-server has every subscription above when start()
        # returns (readiness, and requests and audit records sent right after are
        # not missed; one flush is not enough, see `sync`).
        await sync(self._nc)

    async def drain(self) -> None:
        """Stop taking requests, finish forwarding those already received, stop
        the side loops."""
        for sub in (self._sub, self._gen_sub):
            if sub is not None:
                await leave(sub)
        self._sub = self._gen_sub = None
        if self._audit_sub is not None:
            with contextlib.suppress(Exception):
                await self._audit_sub.unsubscribe()
            self._audit_sub = None
        for nr_sub in (self._nr_gen_sub, self._nr_bundle_sub):
            if nr_sub is not None:
                with contextlib.suppress(Exception):
                    await nr_sub.unsubscribe()
        self._nr_gen_sub = self._nr_bundle_sub = None
        if self._placement is not None:
            await self._placement.stop()
        self._stop.set()
        for task in self._tasks:
            # The route follower may sit in a catalog wait: it need not finish it.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._shadow is not None:
            await self._shadow.stop()

    # --- the request path ----------------------------------------------------
    async def _on_request_observed(self, msg: Msg) -> None:
        """`_on_request`, timed."""
        t0 = time.perf_counter()
        try:
            await self._on_request(msg)
        finally:
            ROUTE_SECONDS.observe(time.perf_counter() - t0)

    async def _on_generate_observed(self, msg: Msg) -> None:
        """`_on_generate`, timed."""
        t0 = time.perf_counter()
        try:
            await self._on_generate(msg, msg.headers if msg.headers is not None else {})
        finally:
            ROUTE_SECONDS.observe(time.perf_counter() - t0)

    async def _on_request(self, msg: Msg) -> None:
        """Route a request bundle; refuse anything else."""
        try:
            bundle = decode_request_bundle(msg.data)
        except FrameError as exc:
            await self._refuse_unframed(msg, exc)
            return
        if not bundle.model or subject_token(bundle.model) != msg.subject.rsplit(".", 1)[-1]:
            # Routes (and so permissions) are per model: the bundle must be for
            # the model its subject names.
            ROUTED.labels(bundle.model, "", StatusCode.INVALID_ARGUMENT.name).inc(
                len(bundle.requests)
            )
            await send_errors(
                self._nc,
                [
                    ReplyTarget(bundle.inbox, r.token, r.envelope.request_id)
                    for r in bundle.requests
                ],
                StatusCode.INVALID_ARGUMENT,
                f"a request bundle for model '{bundle.model}' arrived on {msg.subject}",
            )
            return
        await self._on_bundle(bundle)

    async def _refuse_unframed(self, msg: Msg, exc: FrameError) -> None:
        """A message on a route subject that is not a request bundle: answer
        INVALID_ARGUMENT where it asks to be answered (nothing is computed for
        it), else count it and drop it."""
        try:
            model = name_from_token(msg.subject.rsplit(".", 1)[-1])
        except (ValueError, UnicodeDecodeError):
            model = "-"
        ROUTED.labels(model, "", StatusCode.INVALID_ARGUMENT.name).inc()
        reply = (msg.headers or {}).get(h.REPLY) or msg.reply or ""
        if not reply:
            log.warning("dropped a message that is not a request bundle: %s", exc)
            return
        await send_error(
            self._nc,
            reply,
            InvalidArgument(
                f"{msg.subject} takes request bundles (IBQ1) only (generative requests "
                f"go to {self._subjects.prefix}.genroute.<model>); this message is not "
                f"one ({exc.message}); nothing was computed"
            ),
            (msg.headers or {}).get(h.REQUEST_ID, ""),
        )

    async def _on_generate(self, msg: Msg, headers: dict[str, str]) -> None:
        """Forward a generative request to ``ib.gen`` of the version it is routed to,
        in a span when sampled (its context replaces the request's ``traceparent``)."""
        span = None
        if tracing.enabled():
            span = tracing.start_child_span(ROUTE_SPAN, headers.get(h.TRACEPARENT, ""))
            if span is not None:
                span.set_attribute("inferbus.model", headers.get(h.MODEL, ""))
                span.set_attribute("inferbus.request_id", headers.get(h.REQUEST_ID, ""))
                headers[h.TRACEPARENT] = tracing.traceparent_of(span)
        try:
            await self._forward_generate(msg, headers)
        except BaseException as exc:
            tracing.end_span(span, "INTERNAL", type(exc).__name__)
            raise
        tracing.end_span(span)

    async def _forward_generate(self, msg: Msg, headers: dict[str, str]) -> None:
        model = headers.get(h.MODEL) or name_from_token(msg.subject.rsplit(".", 1)[-1])
        reply = headers.get(h.REPLY) or msg.reply or ""
        request_id = headers.get(h.REQUEST_ID, "")
        route = self._catalog.routes.get(model)
        try:
            weight = None
            if route is not None and route.canary:
                weight = self._canary_weight(route)
            key = stickiness_key(route, headers.get(h.TENANT, ""), headers.get(h.STICKY_KEY, ""))
            decision = decide(
                route,
                model,
                headers.get(h.VERSION, ""),
                sticky_key=key,
                canary_weight=weight,
                draw=self._draw,
            )
        except InferbusError as exc:
            code, _ = status_of(exc)
            ROUTED.labels(model, "", code.name).inc()
            await send_error(self._nc, reply, exc, request_id)
            return
        version = decision.version
        out = dict(headers)
        out[h.VERSION] = version
        out[h.MODEL] = model
        if reply:
            out[h.REPLY] = reply
        # Our inbox + model, version and the client's reply as NATS reply subject:
        # LLM workers leave their queue group while full, so "no responders" means
        # every worker of the version is full (or none runs), and
        # `_on_no_gen_responders` answers 429 (or 503) at once instead of at the deadline.
        nr_reply = ""
        if reply:
            tokens = f"{subject_token(model)}.{subject_token(version)}"
            nr_reply = f"{self._nr_gen_inbox}.{tokens}.{reply}"
        placed = False
        if self._placement is not None and nr_reply:
            # Placement pays only with a choice: one worker holds every prefix anyway.
            ready = self._catalog.ready_workers(model, version)
            if len(ready) > 1:
                workers = [w.worker_id for w in ready]
                placed = await self._placement.send(
                    model, version, msg.data, out, workers, nr_reply
                )
        if not placed:
            await self._nc.publish(
                self._subjects.gen(model, version), msg.data, reply=nr_reply, headers=out
            )
        ROUTED.labels(model, version, "OK").inc()
        DECISIONS.labels(model, version, decision.reason).inc()

    async def _on_bundle(self, bundle: RequestBundle) -> None:
        """Route every request of a bundle; forward one bundle per chosen version."""
        model = bundle.model
        route = self._catalog.routes.get(model)
        weight = None
        if route is not None and route.canary:
            weight = self._canary_weight(route)
        shadow_ready = (
            route is not None
            and self._shadow is not None
            and bool(route.shadow)
            and self._catalog.is_ready(model, route.shadow)
        )
        by_version: dict[str, list[BundledRequest]] = {}
        shadows: list[BundledRequest] = []
        shadow_inbox = ""
        refused: dict[tuple[StatusCode, str], list[ReplyTarget]] = {}
        tracing_on = tracing.enabled()
        for r in bundle.requests:
            env = r.envelope
            try:
                key = stickiness_key(route, env.tenant, env.sticky_key)
                decision = decide(
                    route,
                    model,
                    env.version,
                    sticky_key=key,
                    canary_weight=weight,
                    draw=self._draw,
                )
            except InferbusError as exc:
                code, message = status_of(exc)
                ROUTED.labels(model, "", code.name).inc()
                target = ReplyTarget(bundle.inbox, r.token, env.request_id)
                refused.setdefault((code, message), []).append(target)
                continue
            assert route is not None
            version = decision.version
            if tracing_on and tracing.is_sampled(env.traceparent):
                span = tracing.start_child_span(ROUTE_SPAN, env.traceparent)
                if span is not None:
                    span.set_attribute("inferbus.model", model)
                    span.set_attribute("inferbus.request_id", env.request_id)
                    r.envelope = env = env._replace(traceparent=tracing.traceparent_of(span))
                    tracing.end_span(span)
            # Only the router may set a mirror: whatever a gateway put there is dropped.
            r.mirror, r.mirror_token = "", 0
            if shadow_ready and wants_shadow(route, decision, self._draw):
                assert self._shadow is not None
                pair = self._shadow.begin(model, version, route.shadow, env.request_id)
                if pair is not None:
                    r.mirror, shadow_inbox, r.mirror_token = pair
                    # The same (frozen) envelope: the copy is the request, answered elsewhere.
                    shadows.append(BundledRequest(env, r.mirror_token, r.held_ns, frame=r.frame))
            by_version.setdefault(version, []).append(r)
            ROUTED.labels(model, version, "OK").inc()
            DECISIONS.labels(model, version, decision.reason).inc()
        for (code, message), targets in refused.items():
            await send_errors(self._nc, targets, code, message)
        for version, requests in by_version.items():
            subject = self._subjects.infer(model, version)
            for i in range(0, len(requests), _NR_TOKENS):
                part = requests[i : i + _NR_TOKENS]
                # nats-server's "no responders" (no batcher) comes back to us with
                # the tokens and the gateway's inbox in its subject: no state kept.
                tokens = "_".join(str(r.token) for r in part)
                await self._nc.publish(
                    subject,
                    encode_request_bundle(
                        model, version, bundle.inbox, part, [(r.frame,) for r in part]
                    ),
                    reply=f"{self._nr_bundle_inbox}.{tokens}.{bundle.inbox}",
                )
        if shadows and route is not None:
            try:
                await self._nc.publish(
                    self._subjects.infer(model, route.shadow),
                    encode_request_bundle(
                        model, route.shadow, shadow_inbox, shadows, [(r.frame,) for r in shadows]
                    ),
                )
            except Exception as exc:  # the shadow path never fails the request
                assert self._shadow is not None
                for r in shadows:
                    self._shadow.cancel(r.token)
                log.warning("shadow copies not sent: %s", exc, extra={"model": model})

    async def _on_no_bundle_responders(self, msg: Msg) -> None:
        """No batcher took a forwarded bundle: answer its requests UNAVAILABLE now."""
        if not is_no_responders(msg):
            return
        headers = msg.headers or {}
        tokens, _, inbox = msg.subject[len(self._nr_bundle_inbox) + 1 :].partition(".")
        try:
            targets = [ReplyTarget(inbox, int(t)) for t in tokens.split("_")]
        except ValueError:
            return
        where = headers.get("Nats-Subject", "the version's subject")
        await send_errors(
            self._nc,
            targets,
            StatusCode.UNAVAILABLE,
            f"no batcher is subscribed to {where} (restarting?); nothing was computed, "
            "safe to retry",
        )

    def _canary_weight(self, route: Route) -> float:
        """The canary percent for this request: the health-scaled weight, or 0 while no
        live worker reports the canary ready (a version that is loading, or that its
        workers refuse, takes no traffic: its requests would only fail)."""
        weight = (
            self._health.effective_weight(route)
            if self._health is not None
            else route.canary_weight
        )
        if weight > 0 and not self._catalog.is_ready(route.model, route.canary):
            return 0.0
        return weight

    async def _on_no_gen_responders(self, msg: Msg) -> None:
        """No LLM worker took a generative request: 429 if the version's workers are
        all full, 503 if none serves it. Nothing was generated either way."""
        if not is_no_responders(msg):
            return
        rest = msg.subject[len(self._nr_gen_inbox) + 1 :]
        model_token, version_token, reply = rest.split(".", 2)
        model, version = name_from_token(model_token), name_from_token(version_token)
        exc = no_generation_worker(self._catalog, model, version)
        ROUTED.labels(model, version, exc.code.name).inc()
        await send_error(self._nc, reply, exc)

    # --- side loops ----------------------------------------------------------
    async def _on_audit(self, msg: Msg) -> None:
        assert self._health is not None
        self._health.observe(msg.data)

    async def _health_loop(self) -> None:
        assert self._health is not None
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._health_interval)
            self._health.evaluate(self._catalog.routes)

    async def _follow_routes(self) -> None:
        while not self._stop.is_set():
            # Wakes on any catalog update (or each second, to notice shutdown).
            await self._catalog.wait_for(self._revisions_changed, timeout=1.0)
            self._note_revisions()

    def _revisions_changed(self) -> bool:
        if self._stop.is_set():
            return True
        routes = self._catalog.routes
        if routes.keys() != self._revisions.keys():
            return True
        return any(r.revision != self._revisions[m] for m, r in routes.items())

    def _note_revisions(self) -> None:
        routes = dict(self._catalog.routes)
        for model, route in routes.items():
            seen = self._revisions.get(model)
            if seen == route.revision:
                continue
            self._revisions[model] = route.revision
            ROUTE_REVISION.labels(model).set(route.revision)
            log.info(
                "route revision %d",
                route.revision,
                extra={
                    "model": model,
                    "revision": route.revision,
                    "updated_by": route.updated_by,
                    "change": route.change,
                    "stable": route.stable,
                    "canary": route.canary,
                    "canary_weight": route.canary_weight,
                    "shadow": route.shadow,
                    "shadow_rate": route.shadow_rate,
                    "sticky": route.sticky,
                },
            )
        for model in [m for m in self._revisions if m not in routes]:
            del self._revisions[model]
            with contextlib.suppress(KeyError):
                ROUTE_REVISION.remove(model)
            log.info("route removed", extra={"model": model})
