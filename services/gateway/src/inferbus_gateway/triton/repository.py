"""Triton's model repository extension (index, load, unload) mapped onto the
registry's gRPC API and the workers' heartbeats, so ``tritonclient``'s
repository calls work unchanged. See docs/architecture.md ("Triton's model
repository extension").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
from prometheus_client import Counter

from inferbus_common.catalog import Catalog
from inferbus_common.errors import (
    FailedPrecondition,
    InferbusError,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
    error_from_status,
)
from inferbus_common.registrychannel import registry_channel
from inferbus_gateway.dispatch.lazyload import LazyLoader
from inferbus_gateway.dispatch.noworker import last_worker_text
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

REPOSITORY_CALLS = Counter(
    "inferbus_gateway_repository_calls_total",
    "Triton repository extension calls (index, load, unload) by result.",
    ["call", "status"],
)

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"

Authorize = Callable[[Mapping[str, str], str], Awaitable[None]]
"""``authorize(headers, model)``: raises Unauthenticated / PermissionDenied."""


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One row of the repository index (Triton's ``ModelIndex``)."""

    name: str
    version: str
    state: str
    reason: str = ""

    def as_json(self) -> dict[str, str]:
        """The REST form of the row."""
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state,
            "reason": self.reason,
        }


def parameter_text(params: Mapping[str, Any], name: str) -> str:
    """A string parameter of a load/unload request ('' when absent).

    Raises:
        InvalidArgument: the parameter is there but not a string.
    """
    value = params.get(name)
    if value is None:
        return ""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        raise InvalidArgument(f"repository parameter {name!r} must be a string")
    return value


def _check_parameters(params: Mapping[str, Any]) -> None:
    unsupported = sorted(k for k in params if k == "config" or k.startswith("file:"))
    if unsupported:
        raise InvalidArgument(
            f"load parameters {unsupported} are not supported: inferbus loads versions "
            "from its registry; push a new version with `inferbus models push` and load "
            'it with the "version" parameter'
        )


class RepositoryExtension:
    """The index/load/unload operations behind both REST and gRPC.

    Args:
        catalog: the gateway's live catalog (routes, versions, worker states).
        registry_url: ``host:port`` of the registry's gRPC API ('' = not
            configured: every call answers UNAVAILABLE saying so).
        authorize: the gateway's per-model access check.
        timeout_s: deadline of each registry call.
        load_timeout_s: how long a load waits for a worker to report ready.
        lazy: load hints, so that loading a ``lazy`` version loads it now.
    """

    def __init__(
        self,
        catalog: Catalog,
        registry_url: str,
        authorize: Authorize,
        *,
        timeout_s: float = 10.0,
        load_timeout_s: float = 60.0,
        lazy: LazyLoader | None = None,
        registry_token: str | None = None,
    ) -> None:
        self._catalog = catalog
        self._registry_url = registry_url
        self._registry_token = registry_token
        self._authorize = authorize
        self._timeout_s = timeout_s
        self._load_timeout_s = load_timeout_s
        self._lazy = lazy
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.RegistryAsyncStub | None = None

    async def __aenter__(self) -> RepositoryExtension:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the registry channel (opened on first use). Idempotent."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    # --- registry calls ---------------------------------------------------------
    def _registry(self) -> registry_pb2_grpc.RegistryAsyncStub:
        if self._stub is None and self._registry_url:
            self._channel = registry_channel(self._registry_url, self._registry_token)
            self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        if self._stub is None:
            raise Unavailable(
                "the model repository extension needs the registry's address: set "
                "INFERBUS_GATEWAY_REGISTRY_URL (host:port of the registry's gRPC API)"
            )
        return self._stub

    def _failed(self, what: str, exc: grpc.aio.AioRpcError) -> Exception:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return Unavailable(
                f"the registry at {self._registry_url} did not answer {what} "
                f"({exc.code().name}: {exc.details()}); retry when it is back"
            )
        return error_from_status(exc.code().name, exc.details() or exc.code().name)

    async def _call(self, what: str, request: Any) -> Any:
        stub = self._registry()
        try:
            return await getattr(stub, what)(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed(what, exc) from None

    async def read_file(
        self, model: str, version: str, path: str, *, max_bytes: int = 16 << 20
    ) -> bytes:
        """A (small) file of a stored version, e.g. a labels file, from the registry.

        Raises:
            Unavailable: the registry did not answer.
            FailedPrecondition: the file is larger than `max_bytes`.
            InferbusError: the registry's refusal (NOT_FOUND ...).
        """
        stub = self._registry()
        request = registry_pb2.DownloadFileRequest(model=model, version=version, path=path)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in stub.DownloadFile(request, timeout=self._timeout_s):
                size += len(chunk.data)
                if size > max_bytes:
                    raise FailedPrecondition(
                        f"{model}/{version}/{path} is larger than {max_bytes} bytes"
                    )
                chunks.append(chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise self._failed("DownloadFile", exc) from None
        return b"".join(chunks)

    # --- the three operations ------------------------------------------------------
    async def index(
        self, headers: Mapping[str, str], *, ready_only: bool = False
    ) -> list[IndexEntry]:
        """Every version the registry holds, with its Triton state and reason.

        Models the caller may not access are left out (an unauthenticated
        caller is refused).
        """
        resp = await self._call("ListModels", registry_pb2.ListModelsRequest())
        entries: list[IndexEntry] = []
        for model in resp.models:
            try:
                await self._authorize(headers, model.name)
            except PermissionDenied:
                continue
            for version in model.versions:
                entry = self._entry(model, version)
                if not ready_only or entry.state == READY:
                    entries.append(entry)
        return entries

    def _entry(self, model: registry_pb2.ModelInfo, version: str) -> IndexEntry:
        name = model.name
        if version in model.archived:
            return IndexEntry(name, version, UNAVAILABLE, "archived")
        if model.unloaded:
            return IndexEntry(name, version, UNAVAILABLE, "unloaded")
        aliases = sorted(a for a, v in model.aliases.items() if v == version)
        if not aliases:
            return IndexEntry(name, version, UNAVAILABLE, "not routed: no alias points at it")
        state = self._catalog.version_state(name, version)
        if state == "ready":
            return IndexEntry(name, version, READY, f"aliases: {', '.join(aliases)}")
        if state.startswith("loading"):
            return IndexEntry(name, version, LOADING, state)
        if state == "no worker":
            # The same words as a request's answer (noworker.py): who served it last.
            last = last_worker_text(self._catalog, name, version, time.time() * 1000)
            return IndexEntry(name, version, UNAVAILABLE, f"no worker ({last})" if last else state)
        return IndexEntry(name, version, UNAVAILABLE, state)

    async def load(self, headers: Mapping[str, str], model: str, params: Mapping[str, Any]) -> str:
        """Put `model` into serving and wait until its stable version is ready.

        Returns:
            The version that serves.

        Raises:
            InvalidArgument: unsupported parameters (``config``, ``file:...``).
            NotFound, FailedPrecondition: from the registry (unknown, archived).
            Unavailable: a worker failed to load it (with its reason), or it was
                not ready within the load timeout.
        """
        await self._authorize(headers, model)
        _check_parameters(params)
        version = parameter_text(params, "version")
        info = await self._call(
            "SetServing",
            registry_pb2.SetServingRequest(
                model=model, serving=True, version=version, requested_by="repository-extension"
            ),
        )
        stable = dict(info.aliases).get("stable", "")
        t0 = time.monotonic()

        def routed() -> bool:
            route = self._catalog.routes.get(model)
            return route is not None and route.stable == stable

        def settled() -> bool:
            state = self._catalog.version_state(model, stable)
            return routed() and (state == "ready" or state.startswith("failed"))

        await self._catalog.wait_for(routed, self._load_timeout_s)
        left = max(0.0, self._load_timeout_s - (time.monotonic() - t0))
        dv = self._catalog.versions.get((model, stable))
        if self._lazy is not None and dv is not None and dv.config.load_policy == "lazy":
            await self._lazy.wait_ready(model, stable, left)  # a load loads it now
        else:
            await self._catalog.wait_for(settled, left)
        state = self._catalog.version_state(model, stable)
        if state == "ready":
            log.info(
                "repository load: ready",
                extra={
                    "model": model,
                    "version": stable,
                    "latency_ms": round((time.monotonic() - t0) * 1000, 1),
                },
            )
            return stable
        if state.startswith("failed"):
            raise Unavailable(f"model '{model}' version '{stable}' failed to load: {state[7:]}")
        raise Unavailable(
            f"model '{model}' version '{stable}' is not ready after "
            f"{self._load_timeout_s:g}s ({state}); loading continues, poll is_model_ready"
        )

    async def unload(self, headers: Mapping[str, str], model: str) -> None:
        """Take `model` out of serving (route withdrawn; files and aliases kept)."""
        await self._authorize(headers, model)
        await self._call(
            "SetServing",
            registry_pb2.SetServingRequest(
                model=model, serving=False, requested_by="repository-extension"
            ),
        )
        # Return once this gateway stops routing it, so ModelReady is false at once.
        await self._catalog.wait_for(lambda: model not in self._catalog.routes, self._timeout_s)

    async def run(self, call: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run one operation, counting it by result."""
        try:
            result = await fn()
        except InferbusError as exc:
            REPOSITORY_CALLS.labels(call, exc.code.name).inc()
            raise
        REPOSITORY_CALLS.labels(call, "OK").inc()
        return result
