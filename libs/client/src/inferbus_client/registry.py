"""An asyncio client of the registry's gRPC API, for the ``inferbus`` CLI, tests,
scripts and services, with the push and download helpers the CLI's blocking
commands share (`inferbus_client.artifacts`).

Example::

    async with RegistryClient("127.0.0.1:8070") as registry:
        info = await registry.push("models/fraud/", "fraud", "1.0.0", aliases=["stable"])
        print(info.digest)
        await registry.set_alias("fraud", "canary", "1.0.0")
        await registry.download("fraud", "stable", "model.onnx", Path("/tmp/model.onnx"))

Every method raises the `inferbus_common.errors` class matching the gRPC
status (`InvalidArgument`, `NotFound`, `FailedPrecondition`, `Unavailable`,
...), with the registry's message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc

from inferbus_client.artifacts import (
    DigestMismatch,
    VerifiedFile,
    collect_files,
    push_messages,
)
from inferbus_common.errors import InferbusError, Internal, NotFound, error_from_status
from inferbus_common.registrychannel import registry_channel
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc

_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")


def _error(exc: grpc.aio.AioRpcError) -> InferbusError:
    return error_from_status(exc.code().name, exc.details() or exc.code().name)


class RegistryClient:
    """Asyncio client of `inferbus.registry.v1.Registry`.

    Use as ``async with RegistryClient(target) as client``; or call `close`.

    Args:
        target: ``host:port`` of the registry's gRPC API.
        timeout_s: deadline of each call except push and download, which may
            move gigabytes and have none unless given.
        token: the registry's admin or reader token, when it requires one.
    """

    def __init__(self, target: str, *, timeout_s: float = 30.0, token: str | None = None) -> None:
        self._channel = registry_channel(target, token)
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._timeout = timeout_s

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def push(
        self,
        path: Path | str,
        name: str,
        version: str,
        aliases: Iterable[str] = (),
        *,
        timeout_s: float | None = None,
    ) -> registry_pb2.VersionInfo:
        """Upload a version from a directory or a single model file.

        Files are read and sent in 1 MiB chunks (never whole), from a worker
        thread so the event loop stays free. Re-pushing the same content is a
        harmless no-op; different content for an existing version fails.

        Args:
            path: version directory, or a model file with config.json beside it.
            name: model name.
            version: semantic version (``1``, ``1.2``, ``1.2.3``, ``1.2.3-rc.1``).
            aliases: aliases to point at the version (e.g. ``["stable"]``).
            timeout_s: optional deadline of the whole upload.

        Returns:
            The stored version (digest, files with SHA-256, manifest, config).

        Raises:
            InvalidArgument: bad name, version, config or model file.
            FailedPrecondition: the version exists with different content.
        """
        config_json, files = await asyncio.to_thread(
            collect_files, Path(path), None, validate=False
        )
        messages = push_messages(name, version, config_json, list(aliases), files)

        async def stream() -> AsyncIterator[registry_pb2.PushChunk]:
            while (msg := await asyncio.to_thread(next, messages, None)) is not None:
                yield msg

        try:
            return await self._stub.PushVersion(stream(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def list_models(self) -> list[registry_pb2.ModelInfo]:
        """Every model with its versions (ascending) and aliases."""
        resp = await self._unary(self._stub.ListModels, registry_pb2.ListModelsRequest())
        return list(resp.models)

    async def get_version(self, model: str, version: str = "") -> registry_pb2.VersionInfo:
        """One version by number or alias; empty means ``stable``.

        Raises:
            NotFound: unknown model, version or alias.
        """
        return await self._unary(
            self._stub.GetVersion, registry_pb2.GetVersionRequest(model=model, version=version)
        )

    async def set_alias(
        self, model: str, alias: str, version: str, *, force: bool = False
    ) -> registry_pb2.ModelInfo:
        """Point `alias` at `version` (``stable`` moves the route once it is ready).

        Args:
            model: model name.
            alias: alias name.
            version: version it points at.
            force: skip the registry's artifact check (workers still verify).

        Raises:
            NotFound: unknown model or version.
            InvalidArgument: malformed alias, or ``latest`` (managed by the registry).
            FailedPrecondition: the stored artifact fails its digest or signature check.
        """
        return await self._unary(
            self._stub.SetAlias,
            registry_pb2.SetAliasRequest(model=model, alias=alias, version=version, force=force),
        )

    async def archive(
        self, model: str, version: str, *, requested_by: str = ""
    ) -> registry_pb2.ModelInfo:
        """Archive a version (files kept, out of serving).

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is stable, an alias target, canary or shadow.
        """
        return await self._unary(
            self._stub.ArchiveVersion,
            registry_pb2.ArchiveVersionRequest(
                model=model, version=version, requested_by=requested_by
            ),
        )

    async def unarchive(
        self, model: str, version: str, *, requested_by: str = ""
    ) -> registry_pb2.ModelInfo:
        """Make an archived version usable again.

        Raises:
            NotFound: unknown model or version.
        """
        return await self._unary(
            self._stub.UnarchiveVersion,
            registry_pb2.ArchiveVersionRequest(
                model=model, version=version, requested_by=requested_by
            ),
        )

    async def delete_version(
        self, model: str, version: str, *, requested_by: str = ""
    ) -> registry_pb2.ModelInfo:
        """Delete a version's files and catalog entry.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is in use (see `archive`).
        """
        return await self._unary(
            self._stub.DeleteVersion,
            registry_pb2.DeleteVersionRequest(
                model=model, version=version, requested_by=requested_by
            ),
        )

    async def set_serving(
        self, model: str, serving: bool, version: str = "", *, requested_by: str = ""
    ) -> registry_pb2.ModelInfo:
        """Withdraw a model's route (``serving=False``) or publish it again.

        Args:
            model: model name.
            serving: whether the model should be routed and loaded.
            version: with ``serving=True``, make this version (or alias) stable first.
            requested_by: who asks (recorded in the lifecycle event).

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is archived.
        """
        return await self._unary(
            self._stub.SetServing,
            registry_pb2.SetServingRequest(
                model=model, serving=serving, version=version, requested_by=requested_by
            ),
        )

    async def _unary(
        self, method: grpc.aio.UnaryUnaryMultiCallable[_Request, _Reply], request: _Request
    ) -> _Reply:
        """One unary call with the client's deadline; a gRPC error becomes its `InferbusError`."""
        try:
            return await method(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def download(
        self,
        model: str,
        version: str,
        path: str,
        dest: Path | str,
        *,
        timeout_s: float | None = None,
    ) -> Path:
        """Download one file of a version to `dest` and check its SHA-256.

        The file is written to a temporary file beside `dest` and renamed
        into place only when complete and matching the manifest, so `dest`
        never holds a partial or corrupt file.

        Args:
            model: model name.
            version: version number or alias (empty = ``stable``).
            path: file inside the version, e.g. ``model.onnx``.
            dest: where to write it.
            timeout_s: optional deadline of the download.

        Returns:
            `dest` as a `Path`.

        Raises:
            NotFound: unknown model, version or file.
            Internal: the bytes received do not match the manifest's SHA-256.
        """
        info = await self.get_version(model, version)
        entry = next((f for f in info.files if f.path == path), None)
        if entry is None:
            raise NotFound(
                f"{model} {info.version} has no file {path!r}; "
                f"files: {sorted(f.path for f in info.files)}"
            )
        dest = Path(dest)
        label = f"{model} {info.version} {path}"
        call = self._stub.DownloadFile(
            registry_pb2.DownloadFileRequest(model=model, version=info.version, path=path),
            timeout=timeout_s,
        )
        try:
            with VerifiedFile(dest, entry.sha256, entry.size, label=label) as out:
                async for chunk in call:
                    await asyncio.to_thread(out.write, chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        except DigestMismatch as exc:
            raise Internal(str(exc)) from None
        return dest

    # --- release management: routes, rollouts, pools ------------------------------
    async def get_route(self, model: str, *, history: int = 0) -> registry_pb2.RouteState:
        """The model's route (``route_json``), its KV revision and `history` earlier ones.

        Raises:
            NotFound: unknown model, or a model without a route.
        """
        return await self._unary(
            self._stub.GetRoute, registry_pb2.GetRouteRequest(model=model, history=history)
        )

    async def set_traffic(
        self,
        model: str,
        *,
        canary: str | None = None,
        canary_weight: float | None = None,
        shadow: str | None = None,
        shadow_rate: float | None = None,
        sticky: str | None = None,
        pool: str | None = None,
        expected_kv_revision: int = 0,
        updated_by: str = "",
        change: str = "",
        force: bool = False,
    ) -> registry_pb2.RouteState:
        """Change the traffic split; None keeps a field, '' clears canary/shadow/sticky.

        `force` skips the registry's artifact check of the canary/shadow version.

        Raises:
            FailedPrecondition: `expected_kv_revision` is stale ("route changed,
                re-read"), a rollout owns the canary, or the pool is frozen.
            InvalidArgument: weight/rate out of range, canary equals stable.
            NotFound: unknown model or version.
        """
        # A field given as None is left unset (protobuf's constructors skip None):
        # the registry keeps its current value.
        request = registry_pb2.SetTrafficRequest(
            model=model,
            expected_kv_revision=expected_kv_revision,
            updated_by=updated_by,
            change=change,
            force=force,
            canary=canary,
            canary_weight=canary_weight,
            shadow=shadow,
            shadow_rate=shadow_rate,
            sticky=sticky,
            pool=pool,
        )
        return await self._unary(self._stub.SetTraffic, request)

    async def start_rollout(
        self,
        model: str,
        version: str,
        *,
        steps: Iterable[float] = (5, 25, 50, 100),
        interval_s: float = 60.0,
        max_error_rate: float = 0.01,
        max_p99_ratio: float = 1.5,
        min_requests: int = 20,
        on_fail: str = "rollback",
        requested_by: str = "",
        ready_timeout_s: float = 0.0,
    ) -> registry_pb2.RolloutState:
        """Start a progressive rollout of `version` (``rollout_json`` holds the record).

        Raises:
            FailedPrecondition: a rollout is active, another canary is set, the pool is frozen.
            InvalidArgument: a bad plan.
            NotFound: unknown model or version.
        """
        return await self._unary(
            self._stub.StartRollout,
            registry_pb2.StartRolloutRequest(
                model=model,
                version=version,
                steps=list(steps),
                interval_s=interval_s,
                max_error_rate=max_error_rate,
                max_p99_ratio=max_p99_ratio,
                min_requests=min_requests,
                on_fail=on_fail,
                requested_by=requested_by,
                ready_timeout_s=ready_timeout_s,
            ),
        )

    async def get_rollout(self, model: str) -> registry_pb2.RolloutState:
        """The model's latest rollout.

        Raises:
            NotFound: it never had one.
        """
        return await self._unary(self._stub.GetRollout, registry_pb2.GetRolloutRequest(model=model))

    async def control_rollout(
        self, model: str, action: str, *, requested_by: str = "", reason: str = ""
    ) -> registry_pb2.RolloutState:
        """pause | resume | abort | rollback the model's rollout.

        Raises:
            FailedPrecondition: the action does not fit the rollout's state.
        """
        return await self._unary(
            self._stub.ControlRollout,
            registry_pb2.ControlRolloutRequest(
                model=model, action=action, requested_by=requested_by, reason=reason
            ),
        )

    async def list_pools(self) -> list[registry_pb2.PoolInfo]:
        """The pool ledger."""
        resp = await self._unary(self._stub.ListPools, registry_pb2.ListPoolsRequest())
        return list(resp.pools)

    async def set_pool(
        self,
        name: str,
        *,
        max_workers: int | None = None,
        max_gpus: int | None = None,
        state: str | None = None,
        updated_by: str = "",
    ) -> registry_pb2.PoolInfo:
        """Create or change a pool's quota (0 = unlimited) and release state (open/frozen)."""
        # None leaves a field unset (protobuf's constructors skip None): kept as it is.
        return await self._unary(
            self._stub.SetPool,
            registry_pb2.SetPoolRequest(
                name=name,
                updated_by=updated_by,
                max_workers=max_workers,
                max_gpus=max_gpus,
                state=state,
            ),
        )
