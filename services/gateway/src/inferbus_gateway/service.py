"""Protocol-neutral behaviour of the gateway: health, metadata, inference.

`InferenceService.infer` runs the request pipeline (`inferbus_gateway.pipeline`):
the steps `__main__.build_pipeline` assembles around the `InferHandler` that
reads resolve → validate → dispatch → decode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from nats.aio.client import Client

from inferbus_common.catalog import Catalog, DeployedVersion
from inferbus_common.errors import InferbusError, PermissionDenied
from inferbus_common.modelstats import sum_stats
from inferbus_common.tensorspec import TensorSpec
from inferbus_common.versionnumbers import statistics_labels
from inferbus_gateway.admission import Admission
from inferbus_gateway.canonical import InferRequest, InferResponse
from inferbus_gateway.pipeline import Closable, InferCall, InferHandler, Step, compose
from inferbus_gateway.triton.documents import triton_config, triton_statistics
from inferbus_gateway.triton.sequences import SequenceRouter
from inferbus_gateway.triton.sharedmemory import SystemSharedMemory
from inferbus_gateway.triton.tracelog import LogSettings, TraceSettings

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


def _tensor_metadata(spec: TensorSpec) -> dict[str, object]:
    """The KServe V2 tensor metadata of a spec: name, datatype, shape only."""
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


class InferenceService:
    """What the gateway does, independent of gRPC or REST.

    Args:
        nc: connected NATS client.
        catalog: live catalog of deployed versions, routes and workers.
        handler: answers a request with its model (resolve → validate → dispatch → decode).
        server_name: reported by server metadata.
        version: reported by server metadata.
        steps: the cross-cutting steps around `handler`, outermost first
            (`__main__.build_pipeline`).
        admission: authentication for metadata, statistics and settings calls
            (None: everyone may); requests are admitted by the `Admit` step.
        shared_memory: Triton's system shared-memory regions, registered through
            the front ends (None: not served).
        trace: Triton's trace settings of this gateway (None: the configured ratio).
        log_settings: Triton's log settings of this gateway (None: not changeable).
        settings_tenants: tenants that may change trace and log settings when
            authentication is on.
    """

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        handler: InferHandler,
        *,
        server_name: str,
        version: str,
        steps: Sequence[Step] = (),
        admission: Admission | None = None,
        shared_memory: SystemSharedMemory | None = None,
        trace: TraceSettings | None = None,
        log_settings: LogSettings | None = None,
        settings_tenants: Sequence[str] = (),
        stack_id: str = "",
    ) -> None:
        self._nc = nc
        self.stack_id = stack_id
        self._catalog = catalog
        self._handler = handler
        self.server_name = server_name
        self.version = version
        self.catalog_loaded = False
        self._steps = tuple(steps)
        self._pipeline = compose(self._steps, handler)
        self._admission = admission
        self.shared_memory = shared_memory
        self.trace = trace
        self.log_settings = log_settings
        self._settings_tenants = frozenset(settings_tenants)

    @property
    def sequences(self) -> SequenceRouter | None:
        """The router of stateful models' sequences (None: not served)."""
        return self._handler.dispatch.sequences

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

    def server_metadata(self) -> dict[str, Any]:
        """Name, version and extensions."""
        return {"name": self.server_name, "version": self.version, "extensions": SERVER_EXTENSIONS}

    def resolve(self, model: str, version: str = "") -> DeployedVersion:
        """The deployed version a (model, version) names.

        Raises:
            NotFound: naming the model (and version) that does not exist.
        """
        return self._handler.resolve(model, version)

    def model_ready(self, model: str, version: str = "") -> bool:
        """A live worker serves the model version (unknown models are not ready)."""
        try:
            dv = self.resolve(model, version)
        except InferbusError:
            return False
        return self._catalog.version_state(dv.model, dv.version) == "ready"

    def model_metadata(self, model: str, version: str = "") -> dict[str, Any]:
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

    def infer(
        self, request: InferRequest, protocol: str, headers: Mapping[str, str] | None = None
    ) -> Awaitable[InferResponse]:
        """Admit, validate, send into the platform and wait for the answer.

        The request goes through the steps (`inferbus_gateway.pipeline.steps`)
        to the handler. When admission refuses for load (breaker open, a limit
        hit) or the model fails (unavailable, deadline), and the model's config
        has a fallback (fixed outputs or a backup model), it answers instead,
        marked `degraded`.

        Returns the pipeline's own awaitable (no coroutine of its own: this is on
        every request's path).

        Raises:
            InferbusError: with the status the client should see (when awaited).
        """
        return self._pipeline(InferCall.start(request, protocol, headers))

    async def close(self) -> None:
        """Finish what the steps hold: publish the audit records still collected
        (call before the NATS connection drains)."""
        for step in self._steps:
            if isinstance(step, Closable):
                await step.close()
