"""The handler at the centre of the pipeline: resolve → validate → dispatch → decode.

`InferHandler` answers one call with the model itself; everything around it
(admission, idempotency, shared memory, fallback, audit, observers) is a step
in `inferbus_gateway.pipeline.steps`. Its two pluggable stages are objects of
their own: `Readiness` (is the version ready; lazy loads) and `Dispatch` (the
one place the gateway sends a request into the platform).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable

from inferbus_common.catalog import Catalog, DeployedVersion, Route
from inferbus_common.catalogrecords import is_rejected, not_ready_error
from inferbus_common.errors import (
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.tensors import decode_tensors
from inferbus_common.resolver import decide
from inferbus_common.validation import RequestChecker
from inferbus_common.versionnumbers import check_version_text
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.dispatch.dispatcher import Dispatcher, Reply
from inferbus_gateway.dispatch.lazyload import LazyLoader
from inferbus_gateway.dispatch.noworker import no_worker_error, wait_for_worker_s
from inferbus_gateway.pipeline.call import InferCall
from inferbus_gateway.triton.sequences import SequenceRouter, check_sequence_request

MAX_REQUEST_ID = 256
_MAX_CHECKERS = 1024
"""Versions whose request checkers are kept (beyond it they start over)."""


def resolve_version(catalog: Catalog, model: str, version: str = "") -> DeployedVersion:
    """The deployed version a (model, version) names (`Catalog.deployed`).

    Raises:
        InvalidArgument: no model name.
        NotFound: naming the model (and version) that does not exist.
    """
    if not model:
        raise InvalidArgument("a model name is required")
    if version:
        check_version_text(version)
    return catalog.deployed(model, version)


class Readiness:
    """A request goes only to a version its workers serve; a lazy version is loaded first.

    A version no live worker serves is answered at once (`noworker.NoLiveWorker`,
    naming the version and its last worker), unless the rule of
    `noworker.wait_for_worker_s` lets the request wait for one: then it waits
    here until the version is ready again or the grace ends.

    Args:
        catalog: live catalog (each version's state).
        lazy: load hints for ``load_policy: lazy`` versions (None: lazy versions
            are refused as not ready).
        no_worker_grace_s: see `noworker.wait_for_worker_s` (0: never wait).
    """

    def __init__(
        self, catalog: Catalog, lazy: LazyLoader | None = None, *, no_worker_grace_s: float = 0.0
    ) -> None:
        self._catalog = catalog
        self._lazy = lazy
        self._grace_s = no_worker_grace_s

    def ready_now(self, dv: DeployedVersion) -> bool:
        """`dv` is ready and `wait` has nothing to do for it (no lazy version of
        its route to hint): the request goes on without a coroutine of its own.
        O(1): `Catalog.is_ready` is an index lookup."""
        if not self._catalog.is_ready(dv.model, dv.version):
            return False
        if self._lazy is None:
            return True
        route = self._catalog.routes.get(dv.model)
        return route is None or not (route.canary or route.shadow)

    async def wait(self, dv: DeployedVersion, timeout_s: float) -> float:
        """Wait until `dv` is ready (a lazy one: its load, at most `timeout_s`).

        Returns:
            The time the request has left.

        Raises:
            Unavailable: not ready (a lazy version: still loading).
            FailedPrecondition: its workers refuse the version for good.
        """
        state = self._catalog.version_state(dv.model, dv.version)
        lazy = dv.config.load_policy == "lazy"
        if self._lazy is not None:
            await self._lazy.hint_traffic(dv.model)  # lazy canary/shadow versions
            if state != "ready" and lazy:
                # The first request of a lazy version triggers its load (lazyload.py).
                t_wait = time.perf_counter()
                state = await self._lazy.request_wait(dv.model, dv.version, timeout_s)
                timeout_s = max(0.001, timeout_s - (time.perf_counter() - t_wait))
                if state != "ready" and not is_rejected(state):
                    raise Unavailable(
                        f"model '{dv.model}' version '{dv.version}' is loading "
                        f"(load_policy lazy; {state}); retry in a few seconds"
                    )
        if state != "ready" and not is_rejected(state) and not lazy and self._grace_s > 0:
            # No live worker serves it: wait only while one may come back in time.
            wait_s = wait_for_worker_s(
                self._catalog.last_worker(dv.model, dv.version),
                now_ms=time.time() * 1000,
                timeout_s=timeout_s,
                grace_s=self._grace_s,
            )
            if wait_s > 0:
                t_wait = time.perf_counter()
                model, version = dv.model, dv.version
                await self._catalog.wait_for(lambda: self._catalog.is_ready(model, version), wait_s)
                timeout_s = max(0.001, timeout_s - (time.perf_counter() - t_wait))
                state = self._catalog.version_state(dv.model, dv.version)
        if state == "no worker":
            raise no_worker_error(self._catalog, dv.model, dv.version, dv.config.pool)
        if state != "ready":
            # FAILED_PRECONDITION for a version its workers refuse for good, else UNAVAILABLE.
            raise not_ready_error(dv.model, dv.version, state)
        return timeout_s


class Dispatch:
    """Sends a validated request into the platform: the bus dispatcher, or the
    worker holding its sequence for a stateful model.

    Args:
        catalog: live catalog (the model's route: sticky header, direct dispatch).
        dispatcher: sends requests and collects replies.
        sequences: sends requests of stateful models to their sequence's worker
            (None: sequence models are refused as unavailable).
    """

    def __init__(
        self, catalog: Catalog, dispatcher: Dispatcher, sequences: SequenceRouter | None = None
    ) -> None:
        self._catalog = catalog
        self._dispatcher = dispatcher
        self.sequences = sequences

    def send(
        self, call: InferCall, dv: DeployedVersion, deadline_ns: int, pin: str | None = None
    ) -> Awaitable[Reply]:
        """Send the call's request to `dv`'s model and wait for its reply until `deadline_ns`.

        `pin` is the version the request goes to ('' leaves the choice to the
        router; None: the version the client asked for).

        Returns the dispatcher's own awaitable (no coroutine of its own: this is
        on every request's path).

        Raises:
            Unavailable: a sequence model and no sequence router.
            InvalidArgument: a sequence request with more than one row.
        """
        request = call.request
        if request.sequence is not None:
            return self._send_sequence(call, dv, deadline_ns)
        route = self._catalog.routes.get(request.model)
        if call.headers and route is not None and route.sticky.startswith("header:"):
            # The router hashes it; client header names are case-insensitive.
            request.sticky_key = call.headers.get(route.sticky[7:].lower(), "")
        return self._dispatcher.call(
            Envelope(
                call.request_id,
                request.model,
                deadline_ns,
                request.version if pin is None else pin,
                request.priority,
                tuple(request.outputs),
                request.traceparent,
                request.tenant,
                request.sticky_key,
            ),
            request.inputs,
            route=route,
            max_rows=dv.config.max_batch_size,
        )

    async def _send_sequence(self, call: InferCall, dv: DeployedVersion, deadline_ns: int) -> Reply:
        """Send a request of a stateful model to the worker holding its sequence."""
        request = call.request
        assert request.sequence is not None
        if self.sequences is None:
            raise Unavailable("this gateway does not serve sequence models")
        if dv.config.max_batch_size > 0 and any(t.shape[0] != 1 for t in request.inputs):
            raise InvalidArgument(
                f"model '{dv.model}' is a sequence model: each request carries one row "
                "(batch size 1) of its sequence"
            )
        return await self.sequences.call(
            dv,
            request.sequence,
            request_id=call.request_id,
            tensors=request.inputs,
            outputs=request.outputs,
            deadline_ns=deadline_ns,
            traceparent=request.traceparent,
            turn=request.turn,
        )


class InferHandler:
    """Answers a call with its model: resolve → validate → dispatch → decode.

    Args:
        catalog: live catalog of deployed versions, routes and workers.
        dispatch: sends requests into the platform.
        readiness: readiness and lazy loads (None: `Readiness` without lazy loads).
        default_timeout_s: deadline for requests that bring none.
    """

    def __init__(
        self,
        catalog: Catalog,
        dispatch: Dispatch,
        *,
        default_timeout_s: float,
        readiness: Readiness | None = None,
    ) -> None:
        self._catalog = catalog
        self.dispatch = dispatch
        self._readiness = readiness if readiness is not None else Readiness(catalog)
        self._default_timeout_s = default_timeout_s
        self._checkers: dict[tuple[str, str], RequestChecker] = {}
        """Per (model, version): validation that skips layouts which passed before."""
        self._targets: dict[tuple[str, str], tuple[Route, DeployedVersion, str | None]] = {}
        """Per (model, pin): what `_target` found, for as long as the route and the
        version's record are the catalog's current objects (a change replaces them)."""

    def resolve(self, model: str, version: str = "") -> DeployedVersion:
        """The deployed version a (model, version) names (`resolve_version`)."""
        return resolve_version(self._catalog, model, version)

    async def __call__(self, call: InferCall) -> InferResponse:
        """Answer `call` with the model; `call.version`/`digest` learn who answered.

        Raises:
            InferbusError: with the status the client should see.
        """
        request = call.request
        if len(request.id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request id is longer than {MAX_REQUEST_ID} characters")
        dv, pin = self._target(request.model, request.version)
        timeout_s = self._validate(call, dv)
        if pin is None:
            pin = self._split_pin(request, dv)
        if not self._readiness.ready_now(dv):
            timeout_s = await self._readiness.wait(dv, timeout_s)
        deadline_ns = h.deadline_from_timeout(timeout_s)
        t_sent = time.perf_counter()
        reply = await self.dispatch.send(call, dv, deadline_ns, pin)
        t_back = time.perf_counter()
        call.version = reply.version or call.version
        call.digest = reply.digest
        return self._decode(call, dv, reply, t_sent, t_back)

    def _validate(self, call: InferCall, dv: DeployedVersion) -> float:
        """Check the request against the version's kind and config; its timeout.

        Raises:
            FailedPrecondition: a model this API does not serve.
            InvalidArgument: inputs or outputs the config does not allow.
        """
        request = call.request
        if dv.config.generative:
            raise FailedPrecondition(
                f"model '{dv.model}' is generative; call it with the OpenAI-compatible "
                "API (POST /v1/chat/completions or /v1/completions) or gRPC "
                "ModelStreamInfer (Triton's vLLM backend inputs)"
            )
        if dv.config.decoupled is not None and not request.streaming:
            raise FailedPrecondition(
                f"model '{dv.model}' is decoupled (0..n responses per request); call it "
                "with the streaming API (gRPC ModelStreamInfer)"
            )
        check_sequence_request(dv, request.sequence)
        self._checker(dv).check(request.inputs, request.outputs)
        timeout_s = request.timeout_s
        if timeout_s is None:
            timeout_s = dv.config.batching.default_timeout_ms / 1000.0
            timeout_s = min(timeout_s, self._default_timeout_s)
        return timeout_s

    def _checker(self, dv: DeployedVersion) -> RequestChecker:
        """The request checker of a version's current config (a re-published config
        gets a new one: layouts that passed the old config are not trusted)."""
        key = (dv.model, dv.version)
        checker = self._checkers.get(key)
        if checker is None or checker.config is not dv.config:
            if len(self._checkers) >= _MAX_CHECKERS:
                self._checkers.clear()
            checker = self._checkers[key] = RequestChecker(dv.config)
        return checker

    def _target(self, model: str, version: str) -> tuple[DeployedVersion, str | None]:
        """The version a request for (`model`, `version`) is validated against, and
        the version to send it to (None: a stable/canary split, `_split_pin`).

        `resolve` names the version (the pinned one, else stable). A pin or a
        route without a canary taking traffic decides here (`resolver.decide`
        without a draw), and the concrete version goes with the request, so the
        router (or the dispatcher's shortcut) runs exactly the version
        validated against. Only a stable/canary split is the router's (it alone
        knows the canary's health factor). Kept per (model, pin) while the
        route and the version's record stay the catalog's current objects.

        Raises:
            InvalidArgument: no model name, or a version string no version can have.
            NotFound: naming the model (and version) that does not exist.
        """
        key = (model, version)
        route = self._catalog.routes.get(model)
        hit = self._targets.get(key)
        if (
            hit is not None
            and hit[0] is route
            and self._catalog.versions.get((model, hit[1].version)) is hit[1]
        ):
            return hit[1], hit[2]
        dv = self.resolve(model, version)
        pin: str | None
        if version:
            pin = dv.version  # a pin decides; `resolve` read it (a version number too)
        else:
            decision = decide(route, model, version, draw=None)
            pin = decision.version if decision.decided else None
        if route is not None:
            if len(self._targets) >= _MAX_CHECKERS:
                self._targets.clear()
            self._targets[key] = (route, dv, pin)
        return dv, pin

    def _split_pin(self, request: InferRequest, dv: DeployedVersion) -> str:
        """On a stable/canary split: '' to leave the choice to the router, or
        stable's version when the canary's config refuses the request (`dv`,
        stable, accepted it: only stable can run it)."""
        route = self._catalog.routes.get(request.model)
        assert route is not None  # a split needs a route
        canary = self._catalog.versions.get((request.model, route.canary))
        if canary is None:
            return ""  # no record: the router sends it nothing (no worker has it ready)
        try:
            self._checker(canary).check(request.inputs, request.outputs)
        except InvalidArgument:
            return dv.version
        return ""

    @staticmethod
    def _decode(
        call: InferCall, dv: DeployedVersion, reply: Reply, t_sent: float, t_back: float
    ) -> InferResponse:
        """The answer a reply carries, or the error it carries raised.

        Raises:
            InferbusError: the reply's error.
            Unavailable: a malformed reply.
        """
        request = call.request
        reply.raise_for_status()
        try:
            outputs = decode_tensors(reply.frame)
        except FrameError:
            raise Unavailable("a worker sent a malformed reply; see the worker logs") from None
        if request.outputs:
            wanted = set(request.outputs)
            outputs = [t for t in outputs if t.name in wanted]
        timings = reply.timings_ms
        total_ms = (time.perf_counter() - call.t0) * 1000.0
        timings["gateway"] = ((t_sent - call.t0) + (time.perf_counter() - t_back)) * 1000.0
        timings["total"] = total_ms
        return InferResponse(
            model=request.model,
            version=reply.version or dv.version,
            id=call.request_id,
            outputs=outputs,
            timings_ms=timings,
            digest=reply.digest or dv.digest,
        )
