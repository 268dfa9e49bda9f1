"""Protocol-neutral behaviour of the gateway: health, metadata, inference."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client

from inferbus_common import headers as h
from inferbus_common.audit import encode_record
from inferbus_common.catalog import Catalog, DeployedVersion, is_rejected, not_ready_error
from inferbus_common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InferbusError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from inferbus_common.loopmetrics import LoopCounter, LoopHistogram
from inferbus_common.modelconfig import TensorSpec
from inferbus_common.modelstats import sum_stats
from inferbus_common.subjects import Subjects
from inferbus_common.validation import RequestChecker
from inferbus_common.versionnumbers import (
    check_version_text,
    downstream_version,
    statistics_labels,
)
from inferbus_common.wire import FrameError, decode_tensors
from inferbus_gateway.admission import Admission, BreakerOpen, fallback_outputs
from inferbus_gateway.auditbatch import AuditBatches
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.dispatch import Dispatcher, Reply
from inferbus_gateway.idempotency import IdempotencyCache
from inferbus_gateway.lazyload import LazyLoader
from inferbus_gateway.sequences import SequenceRouter, check_sequence_request
from inferbus_gateway.sharedmemory import SystemSharedMemory
from inferbus_gateway.tracelog import LogSettings, TraceSettings
from inferbus_gateway.triton import triton_config, triton_statistics

REQUESTS = LoopCounter(
    "inferbus_gateway_requests_total",
    "Inference requests answered by the gateway.",
    ["model", "version", "protocol", "status"],
)
LATENCY = LoopHistogram(
    "inferbus_gateway_request_duration_seconds",
    "End-to-end latency of inference requests seen by the gateway.",
    ["model", "protocol"],
    buckets=(
        0.0005,
        0.001,
        0.002,
        0.003,
        0.005,
        0.0075,
        0.01,
        0.015,
        0.02,
        0.03,
        0.05,
        0.075,
        0.1,
        0.2,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
    ),
)

SERVER_EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
    "sequence",
    "system_shared_memory",
    "trace",
    "logging",
    "parameters",
]
"""Triton protocol extensions this gateway speaks (server metadata lists them)."""
_MAX_CHECKERS = 1024
"""Versions whose request checkers are kept (beyond it they start over)."""
MAX_REQUEST_ID = 256

log = logging.getLogger(__name__)

_ID_PREFIX = secrets.token_hex(8)
_id_counter = itertools.count(1)


def _new_id() -> str:
    """An id for a request that brings none: 32 hex digits like ``uuid4().hex``, a
    random prefix per process and a counter (no system call per id)."""
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


_answered_children: dict[tuple[str, str, str], tuple[Any, Any]] = {}


def _answered_metrics(model: str, version: str, protocol: str) -> tuple[Any, Any]:
    """`REQUESTS` (status OK) and `LATENCY` children of a model version, made once.

    ``labels(...)`` builds and looks up its key on every call; an answered
    request needs both, so their children are kept (one entry per model
    version and protocol, like the metrics' own label sets).
    """
    key = (model, version, protocol)
    children = _answered_children.get(key)
    if children is None:
        children = _answered_children[key] = (
            REQUESTS.labels(model, version, protocol, "OK"),
            LATENCY.labels(model, protocol),
        )
    return children


@dataclass
class _Outcome:
    """What `_infer` learned about a request, kept for its audit record even when it fails."""

    request_id: str = ""
    version: str = ""
    digest: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)


def _tensor_metadata(spec: TensorSpec) -> dict[str, object]:
    """The KServe V2 tensor metadata of a spec: name, datatype, shape only."""
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


class InferenceService:
    """What the gateway does, independent of gRPC or REST.

    Args:
        nc: connected NATS client.
        catalog: live catalog of deployed versions, routes and workers.
        dispatcher: sends requests and collects replies.
        server_name: reported by server metadata.
        version: reported by server metadata.
        default_timeout_s: deadline for requests that bring none.
        idempotency_window_s: how long a retried request id replays its answer.
        admission: authentication, limits, quotas and breakers (None: admit all).
        lazy: load hints for ``load_policy: lazy`` versions (None: lazy versions
            are refused as not ready).
        sequences: sends requests of stateful models to their sequence's worker
            (None: sequence models are refused as unavailable).
        shared_memory: Triton's system shared-memory regions (None: requests
            naming a region are refused).
        trace: Triton's trace settings of this gateway (None: the configured ratio).
        log_settings: Triton's log settings of this gateway (None: not changeable).
        settings_tenants: tenants that may change trace and log settings when
            authentication is on.
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        dispatcher: Dispatcher,
        *,
        server_name: str,
        version: str,
        default_timeout_s: float,
        idempotency_window_s: float = 30.0,
        admission: Admission | None = None,
        audit_subjects: Subjects | None = None,
        audit_max_delay_s: float = 0.0,
        instance: str = "",
        observers: Sequence[Callable[[InferRequest, InferResponse], None]] = (),
        lazy: LazyLoader | None = None,
        sequences: SequenceRouter | None = None,
        shared_memory: SystemSharedMemory | None = None,
        trace: TraceSettings | None = None,
        log_settings: LogSettings | None = None,
        settings_tenants: Sequence[str] = (),
    ) -> None:
        self._nc = nc
        self._catalog = catalog
        self._dispatcher = dispatcher
        self.server_name = server_name
        self.version = version
        self._default_timeout_s = default_timeout_s
        self.catalog_loaded = False
        self._idempotency = IdempotencyCache(idempotency_window_s)
        self._admission = admission
        self._audit = (
            AuditBatches(nc, audit_subjects, max_delay_s=audit_max_delay_s)
            if audit_subjects is not None
            else None
        )
        self._instance = instance
        self._lazy = lazy
        self.sequences = sequences
        self.shared_memory = shared_memory
        self.trace = trace
        self.log_settings = log_settings
        self._settings_tenants = frozenset(settings_tenants)
        self._observers = tuple(observers)
        """Called with every request answered by its model (payload capture, drift)."""
        self._checkers: dict[tuple[str, str], RequestChecker] = {}
        """Per (model, version): validation that skips layouts which passed before."""

    # --- health and metadata ---------------------------------------------------
    def live(self) -> bool:
        """The process is up."""
        return True

    def ready(self) -> tuple[bool, str]:
        """Ready to route requests: connected to NATS and the catalog is loaded."""
        if not self._nc.is_connected:
            return False, "not connected to NATS"
        if not self.catalog_loaded:
            return False, "catalog not loaded yet"
        return True, "ok"

    def server_metadata(self) -> dict[str, object]:
        """Name, version and extensions."""
        return {"name": self.server_name, "version": self.version, "extensions": SERVER_EXTENSIONS}

    def resolve(self, model: str, version: str = "") -> DeployedVersion:
        """The deployed version a (model, version) names.

        Raises:
            NotFound: naming the model (and version) that does not exist.
        """
        if not model:
            raise InvalidArgument("a model name is required")
        if version:
            check_version_text(version)
        dv = self._catalog.resolve(model, version)
        if dv is not None:
            return dv
        if model not in self._catalog.routes and not any(
            m == model for m, _ in self._catalog.versions
        ):
            raise NotFound(f"Request for unknown model: '{model}' is not known to this server")
        if version:
            route = self._catalog.routes.get(model)
            known = route.versions if route else []
            raise NotFound(f"model '{model}' has no version '{version}' (versions: {known})")
        raise NotFound(f"model '{model}' has no stable version deployed")

    def model_ready(self, model: str, version: str = "") -> bool:
        """A live worker serves the model version (unknown models are not ready)."""
        try:
            dv = self.resolve(model, version)
        except InferbusError:
            return False
        return self._catalog.version_state(dv.model, dv.version) == "ready"

    def model_metadata(self, model: str, version: str = "") -> dict[str, object]:
        """KServe V2 model metadata.

        Raises:
            NotFound: unknown model or version.
        """
        dv = self.resolve(model, version)
        route = self._catalog.routes.get(model)
        versions = route.versions if route and not version else [dv.version]
        cfg = dv.config
        return {
            "name": model,
            "versions": versions,
            "platform": cfg.platform,
            "inputs": [_tensor_metadata(s) for s in cfg.inputs],
            "outputs": [_tensor_metadata(s) for s in cfg.outputs],
        }

    def model_config(self, model: str, version: str = "") -> dict[str, object]:
        """Triton's model configuration of a version, as JSON (`tritonconfig`).

        Raises:
            NotFound: unknown model or version.
        """
        return triton_config(model, self.resolve(model, version))

    async def model_statistics(
        self, headers: Mapping[str, str], model: str = "", version: str = ""
    ) -> list[dict[str, object]]:
        """Triton's statistics of a version, every version of a model, or every model.

        Each entry sums what the live workers report for the version in their
        heartbeats (`inferbus_common.modelstats`). Without a model name the
        entries cover the versions in every route the caller may use.

        Raises:
            NotFound: unknown model or version.
            Unauthenticated, PermissionDenied: the caller may not.
        """
        catalog = self._catalog
        if model:
            await self.authorize(headers, model)
            if version:
                dv = self.resolve(model, version)
                keys = [(dv.model, dv.version)]
            else:
                route = catalog.routes.get(model)
                keys = [(model, v) for v in (route.versions if route else [])]
                keys = [k for k in keys if k in catalog.versions] or [
                    (model, self.resolve(model).version)
                ]
        else:
            names = sorted(catalog.routes)
            if self._admission is not None:
                principal = await self._admission.authenticator.authenticate(headers)
                allowed = []
                for name in names:
                    try:
                        await self._admission.authenticator.authorize(principal, name)
                    except PermissionDenied:
                        continue
                    allowed.append(name)
                names = allowed
            keys = [
                (name, v)
                for name in names
                for v in catalog.routes[name].versions
                if (name, v) in catalog.versions
            ]
        # Labelled as Triton's tools look statistics up: by integer
        # (`versionnumbers.statistics_labels`).
        return [
            triton_statistics(m, label, stats)
            for m, v in sorted(keys)
            for stats in [sum_stats(catalog.version_stats(m, v))]
            for label in statistics_labels(
                version if model else "", v, catalog.versions[(m, v)].number
            )
        ]

    async def caller(self, headers: Mapping[str, str]) -> str:
        """The authenticated caller's tenant ('' without admission), e.g. the owner
        of shared-memory regions.

        Raises:
            Unauthenticated: no or bad credentials.
        """
        if self._admission is None:
            return ""
        return (await self._admission.authenticator.authenticate(headers)).tenant

    async def authorize_settings(self, headers: Mapping[str, str], *, change: bool) -> None:
        """Check the caller may read (or `change`) the trace and log settings.

        Raises:
            Unauthenticated: no or bad credentials.
            PermissionDenied: a change by a tenant not in ``settings_tenants``.
        """
        if self._admission is None:
            return
        auth = self._admission.authenticator
        principal = await auth.authenticate(headers)
        if change and auth.enabled and principal.tenant not in self._settings_tenants:
            raise PermissionDenied(
                f"tenant '{principal.tenant}' may not change the gateway's settings "
                "(INFERBUS_GATEWAY_SETTINGS_TENANTS)"
            )

    # --- inference -------------------------------------------------------------
    async def authorize(self, headers: Mapping[str, str], model: str) -> None:
        """Authenticate the caller and check it may use `model` (metadata calls).

        Raises:
            Unauthenticated, PermissionDenied: the caller may not.
        """
        if self._admission is not None:
            principal = await self._admission.authenticator.authenticate(headers)
            await self._admission.authenticator.authorize(principal, model)

    async def infer(
        self, request: InferRequest, protocol: str, headers: Mapping[str, str] | None = None
    ) -> InferResponse:
        """Admit, validate, send into the platform and wait for the answer.

        When admission refuses for load (breaker open, a limit hit) or the
        model fails (unavailable, deadline), and the model's config has a
        fallback (fixed outputs or a backup model), it answers instead, marked
        `degraded`.

        Raises:
            InferbusError: with the status the client should see.
        """
        t0 = time.perf_counter()
        outcome = _Outcome(request_id=request.id or _new_id(), version=request.version)
        admission = self._admission
        try:
            if admission is not None:
                principal = await admission.admit(
                    headers or {}, model=request.model, interface="ModelInfer"
                )
                request.tenant = principal.tenant
            if request.shm_inputs:
                self._shm().read_inputs(request, request.tenant)
            route = self._catalog.routes.get(request.model)
            if headers and route is not None and route.sticky.startswith("header:"):
                # The router hashes it; client header names are case-insensitive.
                request.sticky_key = headers.get(route.sticky[7:].lower(), "")
            try:
                response = await self._idempotency.run(
                    request, lambda: self._infer(request, t0, outcome)
                )
            except BaseException as exc:
                if admission is not None:
                    admission.record(request.model, exc)  # exactly once per admitted request
                raise
            if admission is not None:
                admission.record(request.model, None)
        except InferbusError as exc:
            fallback = await self._fallback(request, exc, t0)
            if fallback is not None:
                REQUESTS.labels(request.model, fallback.version, protocol, "DEGRADED").inc()
                reason = fallback.degraded
                await self._record(request, protocol, outcome, "DEGRADED", reason, t0)
                return fallback
            REQUESTS.labels(request.model, outcome.version, protocol, exc.code.name).inc()
            reason = exc.reason if isinstance(exc, ResourceExhausted) else ""
            await self._record(request, protocol, outcome, exc.code.name, reason, t0)
            raise
        if request.shm_outputs:
            response = self._shm().write_outputs(request, response, request.tenant)
        answered, latency = _answered_metrics(request.model, response.version, protocol)
        answered.inc()
        latency.observe(time.perf_counter() - t0)
        outcome.version, outcome.digest = response.version, response.digest
        outcome.timings_ms = response.timings_ms
        await self._record(request, protocol, outcome, "OK", "", t0)
        self._observe(request, response)
        return response

    def _shm(self) -> SystemSharedMemory:
        if self.shared_memory is None:
            raise InvalidArgument("system shared memory is not served by this gateway")
        return self.shared_memory

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

    def _observe(self, request: InferRequest, response: InferResponse) -> None:
        """Hand an answered request to the observers; they must never fail it."""
        for observe in self._observers:
            try:
                observe(request, response)
            except Exception as exc:  # observation never fails a request
                log.warning("request observer failed: %s", exc)

    async def _record(
        self,
        request: InferRequest,
        protocol: str,
        outcome: _Outcome,
        status: str,
        reason: str,
        t0: float,
    ) -> None:
        """Queue the request's audit record (`AuditBatches`); never fails the request.

        No round trip: records are published in batches, a few ms later. A
        request that failed before a version was known is recorded with version ''.
        """
        if self._audit is None:
            return
        data = encode_record(
            request_id=outcome.request_id,
            ts_unix_ms=time.time_ns() // 1_000_000,
            gateway=self._instance,
            protocol=protocol,
            tenant=request.tenant,
            model=request.model,
            version=outcome.version,
            digest=outcome.digest,
            status=status,
            reason=reason,
            latency_ms=(time.perf_counter() - t0) * 1000.0,
            stages_ms=outcome.timings_ms,
        )
        await self._audit.add(request.model, data)

    async def close(self) -> None:
        """Publish the audit records still collected (call before the NATS connection drains)."""
        if self._audit is not None:
            await self._audit.close()

    async def _fallback(
        self, request: InferRequest, exc: InferbusError, t0: float
    ) -> InferResponse | None:
        """The model's fallback answer for a load or availability failure.

        A fixed answer (``fallback.outputs``) is built here; a backup model
        (``fallback.model``) is asked once, without admission and without its
        own fallback. None when there is no fallback or it failed too.
        """
        if isinstance(exc, BreakerOpen):
            reason = "breaker-open"
        elif isinstance(exc, ResourceExhausted):
            reason = exc.reason or "limited"
        elif isinstance(exc, DeadlineExceeded):
            reason = "deadline"
        elif isinstance(exc, Unavailable):
            reason = "unavailable"
        else:
            return None
        try:
            dv = self.resolve(request.model, request.version)
        except InferbusError:
            return None
        fb = dv.config.fallback
        if fb is not None and fb.model:
            if reason == "deadline":
                return None  # no time left to ask another model

            backup = InferRequest(
                model=fb.model,
                version=fb.version or "",
                id=request.id,
                inputs=request.inputs,
                outputs=request.outputs,
                priority=request.priority,
                timeout_s=request.timeout_s,
                traceparent=request.traceparent,
                tenant=request.tenant,
            )
            try:
                answer = await self._infer(backup, time.perf_counter())
            except InferbusError:
                return None
            answer.model = request.model
            answer.degraded = f"{reason}; answered by {fb.model} version {answer.version}"
            return answer
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        outputs = fallback_outputs(dv.config, rows, request.outputs)
        if outputs is None:
            return None
        return InferResponse(
            model=request.model,
            version=dv.version,
            id=request.id,
            outputs=outputs,
            timings_ms={"total": (time.perf_counter() - t0) * 1000.0},
            digest=dv.digest,
            degraded=reason,
        )

    async def _sequence_call(
        self, dv: DeployedVersion, request: InferRequest, request_id: str, deadline_ns: int
    ) -> Reply:
        """Send a request of a stateful model to the worker holding its sequence."""
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
            request_id=request_id,
            tensors=request.inputs,
            outputs=request.outputs,
            deadline_ns=deadline_ns,
            traceparent=request.traceparent,
            turn=request.turn,
        )

    async def _infer(
        self, request: InferRequest, t0: float, outcome: _Outcome | None = None
    ) -> InferResponse:
        if len(request.id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request id is longer than {MAX_REQUEST_ID} characters")
        request_id = request.id or (outcome.request_id if outcome else "") or _new_id()
        dv = self.resolve(request.model, request.version)
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
        state = self._catalog.version_state(dv.model, dv.version)
        if self._lazy is not None:
            await self._lazy.hint_traffic(dv.model)  # lazy canary/shadow versions
            if state != "ready" and dv.config.load_policy == "lazy":
                # The first request of a lazy version triggers its load (lazyload.py).
                t_wait = time.perf_counter()
                state = await self._lazy.request_wait(dv.model, dv.version, timeout_s)
                timeout_s = max(0.001, timeout_s - (time.perf_counter() - t_wait))
                if state != "ready" and not is_rejected(state):
                    raise Unavailable(
                        f"model '{dv.model}' version '{dv.version}' is loading "
                        f"(load_policy lazy; {state}); retry in a few seconds"
                    )
        if state != "ready":
            # FAILED_PRECONDITION for a version its workers refuse for good, else UNAVAILABLE.
            raise not_ready_error(dv.model, dv.version, state)
        deadline_ns = h.deadline_from_timeout(timeout_s)
        t_sent = time.perf_counter()
        if request.sequence is not None:
            reply = await self._sequence_call(dv, request, request_id, deadline_ns)
        else:
            reply = await self._dispatcher.call(
                request.model,
                version=downstream_version(request.version, dv.version),
                request_id=request_id,
                tensors=request.inputs,
                outputs=request.outputs,
                deadline_ns=deadline_ns,
                priority=request.priority,
                traceparent=request.traceparent,
                tenant=request.tenant,
                sticky_key=request.sticky_key,
                route=self._catalog.routes.get(request.model),
                max_rows=dv.config.max_batch_size,
            )
        t_back = time.perf_counter()
        if outcome is not None:
            outcome.version = reply.version or outcome.version
            outcome.digest = reply.digest
        reply.raise_for_status()
        try:
            outputs = decode_tensors(reply.frame)
        except FrameError:
            raise Unavailable("a worker sent a malformed reply; see the worker logs") from None
        if request.outputs:
            wanted = set(request.outputs)
            outputs = [t for t in outputs if t.name in wanted]
        timings = reply.timings_ms
        total_ms = (time.perf_counter() - t0) * 1000.0
        timings["gateway"] = ((t_sent - t0) + (time.perf_counter() - t_back)) * 1000.0
        timings["total"] = total_ms
        return InferResponse(
            model=request.model,
            version=reply.version or dv.version,
            id=request_id,
            outputs=outputs,
            timings_ms=timings,
            digest=reply.digest or dv.digest,
        )
