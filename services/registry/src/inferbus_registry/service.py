"""The gRPC `Registry` service: protobuf in, repository and publisher calls, protobuf out.

Typed `InferbusError`s become gRPC statuses with their message; anything else
is logged and answered INTERNAL without its details.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from inferbus_common.catalog import Route
from inferbus_common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc
from inferbus_registry import metrics
from inferbus_registry.grpcerrors import NATS_ERRORS, abort, answer, as_error
from inferbus_registry.pools import PoolBook
from inferbus_registry.publisher import CatalogPublisher
from inferbus_registry.records import ModelState, VersionRecord
from inferbus_registry.release_api import ReleaseRPCs
from inferbus_registry.repository import ModelRepository
from inferbus_registry.rollout import RolloutController
from inferbus_registry.store import CHUNK_SIZE

log = logging.getLogger(__name__)


def version_info(record: VersionRecord, state: ModelState | None) -> registry_pb2.VersionInfo:
    """The protobuf `VersionInfo` of a stored version (aliases from `state`)."""
    aliases = sorted(a for a, v in state.aliases.items() if v == record.version) if state else []
    return registry_pb2.VersionInfo(
        model=record.model,
        version=record.version,
        config_json=record.config_json,
        manifest_json=record.manifest_json,
        digest=record.digest,
        aliases=aliases,
        files=[
            registry_pb2.FileEntry(path=path, size=info.size, sha256=info.sha256)
            for path, info in sorted(record.files.items())
        ],
        created_unix_ms=record.created_unix_ms,
        archived=bool(state and record.version in state.archived),
    )


def model_info(state: ModelState) -> registry_pb2.ModelInfo:
    """The protobuf `ModelInfo` of a model."""
    return registry_pb2.ModelInfo(
        name=state.name,
        versions=list(state.versions),
        aliases=dict(state.aliases),
        archived=list(state.archived),
        unloaded=state.unloaded,
    )


class RegistryService(ReleaseRPCs, registry_pb2_grpc.RegistryServicer):
    """Implements `inferbus.registry.v1.Registry`.

    Args:
        repo: the model repository.
        publisher: writes the catalog to NATS KV and publishes events.
        chunk_size: size of `DownloadFile` chunks.
        drain_timeout_s: how long a refused push may keep sending before the
            call is ended (see `_drain`).
        rollouts: the rollout controller (None: rollout RPCs refused).
        pools: the pools bucket (None: pool RPCs refused).
    """

    def __init__(
        self,
        repo: ModelRepository,
        publisher: CatalogPublisher,
        *,
        chunk_size: int = CHUNK_SIZE,
        drain_timeout_s: float = 60.0,
        rollouts: RolloutController | None = None,
        pools: PoolBook | None = None,
    ) -> None:
        self._repo = repo
        self._rollouts = rollouts
        self._pools = pools
        self._drain_timeout_s = drain_timeout_s
        self._publisher = publisher
        self._chunk_size = chunk_size

    async def _publish(self, record: VersionRecord | None, state: ModelState) -> None:
        try:
            if record is not None:
                await self._publisher.publish_version(record)
            await self._publisher.publish_route(self._repo, state)
        except NATS_ERRORS as exc:
            # The store already holds the change; repeating the call republishes.
            raise Unavailable(
                f"model {state.name!r} is stored but the catalog could not be updated on "
                f"NATS ({type(exc).__name__}); retry the call"
            ) from exc

    async def _push(
        self, messages: AsyncIterator[registry_pb2.PushChunk]
    ) -> registry_pb2.VersionInfo:
        first = await anext(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("the first PushVersion message must be a header")
        header = first.header

        async def chunks() -> AsyncIterator[tuple[str, bytes]]:
            async for msg in messages:
                if msg.WhichOneof("kind") != "chunk":
                    raise InvalidArgument("a PushVersion stream carries exactly one header")
                yield msg.chunk.path, msg.chunk.data

        result = await self._repo.push(
            header.model,
            header.version,
            header.config_json,
            list(header.aliases),
            chunks(),
        )
        metrics.BYTES_STORED.inc(result.bytes_stored)
        await self._publish(result.record, result.state)
        await self._publisher.event(
            header.model,
            "version_pushed",
            version=result.record.version,
            digest=result.record.digest,
            created=result.created,
            aliases=result.state.aliases,
        )
        log.info(
            "version %s",
            "pushed" if result.created else "re-pushed unchanged",
            extra={"model": header.model, "version": header.version},
        )
        metrics.PUSHES.labels("created" if result.created else "unchanged").inc()
        return version_info(result.record, result.state)

    async def PushVersion(
        self,
        request_iterator: AsyncIterable[registry_pb2.PushChunk],
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.VersionInfo:
        """Receive, check, store and publish a version (see the .proto)."""
        messages = aiter(request_iterator)
        try:
            return await self._push(messages)
        except Exception as exc:
            err = as_error(exc, "PushVersion")
        result = {InvalidArgument: "invalid", FailedPrecondition: "conflict"}.get(
            type(err), "error"
        )
        metrics.PUSHES.labels(result).inc()
        await self._drain(messages)
        await abort(context, err)

    async def _drain(self, messages: AsyncIterator[registry_pb2.PushChunk]) -> None:
        """Read and drop the rest of a refused push before answering.

        grpcio's asyncio client reports INTERNAL ("Internal error from Core")
        instead of the server's status when the server ends a client-streamed
        call while a write is in flight (grpc/grpc#36066). Letting the client
        finish sending first makes the real status (e.g. INVALID_ARGUMENT with
        its message) reach it. Bounded in time so a stalled client cannot hold
        the call open.
        """
        try:
            async with asyncio.timeout(self._drain_timeout_s):
                async for _ in messages:
                    pass
        except TimeoutError:
            log.warning("refused push still sending after %.0f s; aborting", self._drain_timeout_s)
        except Exception as exc:
            # The request stream itself failed (client gone); nothing left to drain.
            log.debug("request stream ended while draining: %s", exc)

    async def ListModels(
        self, request: registry_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListModelsResponse:
        """Every model with its versions, their Triton-style numbers, and aliases."""

        async def call() -> registry_pb2.ListModelsResponse:
            infos = []
            for state in await self._repo.list_models():
                info = model_info(state)
                info.numbers.update(await self._repo.numbers(state.name))
                infos.append(info)
            return registry_pb2.ListModelsResponse(models=infos)

        return await answer(context, "ListModels", call)

    async def GetVersion(
        self, request: registry_pb2.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.VersionInfo:
        """One version by number or alias (empty = ``stable``)."""

        async def call() -> registry_pb2.VersionInfo:
            record = await self._repo.get_version(request.model, request.version)
            return version_info(record, await self._repo.state(request.model))

        return await answer(context, "GetVersion", call)

    async def SetAlias(
        self, request: registry_pb2.SetAliasRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelInfo:
        """Point an alias at a version and move the route."""
        try:
            previous = (await self._repo.aliases(request.model)).get(request.alias, "")
            if not request.force:
                # Refuse a corrupt or foreign artifact before anything routes to it.
                await self._repo.verify(request.model, request.version)
            state = await self._repo.set_alias(request.model, request.alias, request.version)
            await self._publish(None, state)
            await self._publisher.event(
                request.model,
                "alias_set",
                alias=request.alias,
                version=request.version,
                previous=previous or None,
                aliases=state.aliases,
                **({"forced": True} if request.force else {}),
            )
            log.info(
                "alias %s set",
                request.alias,
                extra={"model": request.model, "version": request.version},
            )
            return model_info(state)
        except Exception as exc:
            err = as_error(exc, "SetAlias")
        await abort(context, err)

    async def DownloadFile(
        self, request: registry_pb2.DownloadFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.FileChunk]:
        """Stream one file of a version in chunks of at most 1 MiB."""
        try:
            record, chunks = await self._repo.open_file(
                request.model, request.version, request.path, self._chunk_size
            )
            sent = 0
            async for data in chunks:
                sent += len(data)
                yield registry_pb2.FileChunk(path=request.path, data=data)
            metrics.DOWNLOADS.labels("ok").inc()
            metrics.DOWNLOAD_BYTES.inc(sent)
            log.debug(
                "file %s sent (%d bytes)",
                request.path,
                sent,
                extra={"model": record.model, "version": record.version},
            )
            return
        except Exception as exc:
            err = as_error(exc, "DownloadFile")
        metrics.DOWNLOADS.labels("not_found" if isinstance(err, NotFound) else "error").inc()
        await abort(context, err)

    # --- lifecycle: archive, unarchive, delete, serving -------------------------
    async def _lifecycle(
        self,
        context: grpc.aio.ServicerContext,
        what: str,
        change: Callable[[], Awaitable[tuple[ModelState, dict[str, Any]]]],
    ) -> registry_pb2.ModelInfo:
        """Run a lifecycle change, publish the catalog and its event; map errors."""
        try:
            state, event = await change()
            name = event.pop("event")
            await self._publish(None, state)
            await self._publisher.event(state.name, name, aliases=state.aliases, **event)
            metrics.LIFECYCLE.labels(name).inc()
            log.info("%s", name, extra={"model": state.name, "version": event.get("version")})
            return model_info(state)
        except Exception as exc:
            err = as_error(exc, what)
        await abort(context, err)

    async def ArchiveVersion(
        self, request: registry_pb2.ArchiveVersionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelInfo:
        """Archive a version: files kept, catalog entry withdrawn (workers unload it)."""

        async def change() -> tuple[ModelState, dict[str, Any]]:
            live = await self._live_route(request.model)
            state = await self._repo.archive(
                request.model, request.version, request.requested_by, live=live
            )
            await self._unpublish(request.model, request.version)
            return state, {
                "event": "version_archived",
                "version": request.version,
                "requested_by": request.requested_by or None,
            }

        return await self._lifecycle(context, "ArchiveVersion", change)

    async def UnarchiveVersion(
        self, request: registry_pb2.ArchiveVersionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelInfo:
        """Unarchive a version: its catalog entry is published again."""

        async def change() -> tuple[ModelState, dict[str, Any]]:
            state = await self._repo.unarchive(request.model, request.version)
            record = await self._repo.get_version(request.model, request.version)
            try:
                await self._publisher.publish_version(record)
            except NATS_ERRORS as exc:
                raise Unavailable(
                    f"version unarchived in the store but not published on NATS "
                    f"({type(exc).__name__}); retry the call"
                ) from exc
            return state, {
                "event": "version_unarchived",
                "version": request.version,
                "requested_by": request.requested_by or None,
            }

        return await self._lifecycle(context, "UnarchiveVersion", change)

    async def DeleteVersion(
        self, request: registry_pb2.DeleteVersionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelInfo:
        """Delete a version's files and catalog entry (refused while it is in use)."""

        async def change() -> tuple[ModelState, dict[str, Any]]:
            live = await self._live_route(request.model)
            state, freed = await self._repo.delete_version(
                request.model, request.version, live=live
            )
            await self._unpublish(request.model, request.version)
            metrics.BYTES_DELETED.inc(freed)
            return state, {
                "event": "version_deleted",
                "version": request.version,
                "bytes_freed": freed,
                "requested_by": request.requested_by or None,
            }

        return await self._lifecycle(context, "DeleteVersion", change)

    async def SetServing(
        self, request: registry_pb2.SetServingRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelInfo:
        """Withdraw a model's route or publish it again (optionally moving stable)."""

        async def change() -> tuple[ModelState, dict[str, Any]]:
            if request.serving and request.version:
                await self._repo.verify(request.model, request.version)
            state = await self._repo.set_serving(
                request.model, request.serving, request.version, request.requested_by
            )
            return state, {
                "event": "model_loaded" if request.serving else "model_unloaded",
                "version": state.aliases.get("stable"),
                "requested_by": request.requested_by or None,
            }

        return await self._lifecycle(context, "SetServing", change)

    async def _live_route(self, model: str) -> Route | None:
        """The route routers follow now (its canary/shadow are only in KV)."""
        try:
            return await self._publisher.current_route(model)
        except NATS_ERRORS as exc:
            raise Unavailable(
                f"cannot read the route of {model!r} from NATS ({type(exc).__name__}) to check "
                "that nothing routes to the version; retry the call"
            ) from exc

    async def _unpublish(self, model: str, version: str) -> None:
        try:
            await self._publisher.unpublish_version(model, version)
        except NATS_ERRORS as exc:
            raise Unavailable(
                f"the store is updated but the catalog entry of {model!r} {version!r} could "
                f"not be withdrawn on NATS ({type(exc).__name__}); retry the call"
            ) from exc
