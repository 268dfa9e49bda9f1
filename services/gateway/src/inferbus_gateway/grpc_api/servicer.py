"""`inference.GRPCInferenceService` implemented on top of `InferenceService`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from inferbus_common.errors import InferbusError, ResourceExhausted, Unavailable, status_of
from inferbus_gateway.access import RequestScope
from inferbus_gateway.classification import Classifier
from inferbus_gateway.grpc_api.converters import request_from_proto, response_to_proto
from inferbus_gateway.repository import RepositoryExtension
from inferbus_gateway.service import InferenceService
from inferbus_gateway.triton import to_proto
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb
from inferbus_proto.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from inferbus_proto.v2 import model_config_pb2 as mc

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _guard(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
    """Run a handler; map inferbus errors (and anything else) to a gRPC status."""
    try:
        return await fn()
    except InferbusError as exc:
        if isinstance(exc, ResourceExhausted):
            context.set_trailing_metadata(
                (("retry-after", str(max(1, round(exc.retry_after_s)))),)
                + ((("inferbus-reason", exc.reason),) if exc.reason else ())
            )
        await context.abort(grpc.StatusCode[exc.code.grpc_name], exc.message)
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        log.exception("unhandled error in gRPC handler")
        code, message = status_of(exc)
        await context.abort(grpc.StatusCode[code.grpc_name], message)
    raise AssertionError("unreachable")  # context.abort always raises


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """Invocation metadata as a dict of text values (binary ``-bin`` keys skipped)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class GRPCInferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """KServe V2 gRPC servicer."""

    def __init__(
        self,
        service: InferenceService,
        *,
        access_log: bool = True,
        repository: RepositoryExtension | None = None,
        classifier: Classifier | None = None,
    ) -> None:
        self._service = service
        self._access_log = access_log
        self._repository = repository
        self._classifier = classifier

    # --- Triton's model repository extension (inferbus_gateway.repository) ----------
    def _repo(self) -> RepositoryExtension:
        if self._repository is None:
            raise Unavailable(
                "the model repository extension is off: set INFERBUS_GATEWAY_REGISTRY_URL"
            )
        return self._repository

    async def RepositoryIndex(self, request, context):
        """Every registry version with its Triton state (READY, LOADING, UNAVAILABLE)."""

        async def run() -> pb.RepositoryIndexResponse:
            ext = self._repo()
            entries = await ext.run(
                "index", lambda: ext.index(_metadata(context), ready_only=request.ready)
            )
            resp = pb.RepositoryIndexResponse()
            for e in entries:
                resp.models.add(name=e.name, version=e.version, state=e.state, reason=e.reason)
            return resp

        return await _guard(context, run)

    async def RepositoryModelLoad(self, request, context):
        """Put a model into serving (optionally a given "version") and wait until ready."""

        async def run() -> pb.RepositoryModelLoadResponse:
            ext = self._repo()
            params = {
                k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
                for k, v in request.parameters.items()
            }
            await ext.run("load", lambda: ext.load(_metadata(context), request.model_name, params))
            return pb.RepositoryModelLoadResponse()

        return await _guard(context, run)

    async def RepositoryModelUnload(self, request, context):
        """Take a model out of serving (files and aliases kept)."""

        async def run() -> pb.RepositoryModelUnloadResponse:
            ext = self._repo()
            await ext.run("unload", lambda: ext.unload(_metadata(context), request.model_name))
            return pb.RepositoryModelUnloadResponse()

        return await _guard(context, run)

    async def ServerLive(self, request, context):
        """Liveness."""
        return pb.ServerLiveResponse(live=self._service.live())

    async def ServerReady(self, request, context):
        """Readiness."""
        return pb.ServerReadyResponse(ready=self._service.ready()[0])

    async def ModelReady(self, request, context):
        """Model readiness (unknown models are not ready)."""
        return pb.ModelReadyResponse(ready=self._service.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        """Server name, version, extensions."""
        md = self._service.server_metadata()
        return pb.ServerMetadataResponse(
            name=md["name"], version=md["version"], extensions=md["extensions"]
        )

    async def ModelMetadata(self, request, context):
        """Model inputs/outputs/versions."""

        async def run() -> pb.ModelMetadataResponse:
            await self._service.authorize(_metadata(context), request.name)
            md = self._service.model_metadata(request.name, request.version)
            resp = pb.ModelMetadataResponse(
                name=md["name"], versions=md["versions"], platform=md["platform"]
            )
            for spec in md["inputs"]:
                resp.inputs.add(**spec)
            for spec in md["outputs"]:
                resp.outputs.add(**spec)
            return resp

        return await _guard(context, run)

    async def ModelConfig(self, request, context):
        """Triton's model configuration of a model (version)."""

        async def run() -> pb.ModelConfigResponse:
            await self._service.authorize(_metadata(context), request.name)
            doc = self._service.model_config(request.name, request.version)
            return pb.ModelConfigResponse(config=to_proto(doc, mc.ModelConfig()))

        return await _guard(context, run)

    async def ModelStatistics(self, request, context):
        """Triton's statistics of a version, a model's versions, or every model."""

        async def run() -> pb.ModelStatisticsResponse:
            entries = await self._service.model_statistics(
                _metadata(context), request.name, request.version
            )
            return to_proto({"model_stats": entries}, pb.ModelStatisticsResponse())

        return await _guard(context, run)

    async def ModelInfer(self, request, context):
        """Run one inference request."""

        async def run() -> pb.ModelInferResponse:
            headers = _metadata(context)
            scope = RequestScope(
                "grpc", request.model_name, headers.get("traceparent", ""), self._access_log
            )
            with scope:
                canonical = request_from_proto(request, context.time_remaining())
                canonical.traceparent = scope.traceparent
                scope.request = canonical
                response = await self._service.infer(canonical, "grpc", headers)
                scope.response = response
                if canonical.classification:
                    if self._classifier is None:
                        raise Unavailable(
                            "the classification extension needs the registry (labels files)"
                        )
                    await self._classifier.apply(canonical, response)
            if response.degraded:
                context.set_trailing_metadata((("x-inferbus-degraded", response.degraded),))
            return response_to_proto(response)

        return await _guard(context, run)
