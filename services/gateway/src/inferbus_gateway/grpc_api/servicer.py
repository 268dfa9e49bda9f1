"""`inference.GRPCInferenceService` implemented on top of `InferenceService`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from inferbus_common import stackid
from inferbus_common.errors import (
    InferbusError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
    status_of,
)
from inferbus_gateway.generation import GenerationService
from inferbus_gateway.grpc_api.converters import response_to_proto
from inferbus_gateway.grpc_api.stream import StreamHandler, infer_one
from inferbus_gateway.service import InferenceService
from inferbus_gateway.triton.classification import Classifier
from inferbus_gateway.triton.documents import to_proto
from inferbus_gateway.triton.repository import RepositoryExtension
from inferbus_gateway.triton.sharedmemory import CUDA_UNSUPPORTED, SystemSharedMemory
from inferbus_gateway.triton.tracelog import LogSettings, TraceSettings
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


def _log_value(value: object) -> pb.LogSettingsResponse.SettingValue:
    if isinstance(value, bool):
        return pb.LogSettingsResponse.SettingValue(bool_param=value)
    if isinstance(value, int):
        return pb.LogSettingsResponse.SettingValue(uint32_param=value)
    return pb.LogSettingsResponse.SettingValue(string_param=str(value))


class GRPCInferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """KServe V2 gRPC servicer.

    Args:
        service: the protocol-neutral gateway.
        access_log: write one access-log line per inference request.
        repository: Triton's model repository extension (None: UNAVAILABLE).
        classifier: Triton's classification extension (None: refused).
        generation: the generative path, for generative models on ModelStreamInfer.
        stream_max_in_flight: requests of one stream served at once.
    """

    def __init__(
        self,
        service: InferenceService,
        *,
        access_log: bool = True,
        repository: RepositoryExtension | None = None,
        classifier: Classifier | None = None,
        generation: GenerationService | None = None,
        stream_max_in_flight: int = 256,
    ) -> None:
        self._service = service
        self._access_log = access_log
        self._repository = repository
        self._classifier = classifier
        self._stream = StreamHandler(
            service,
            generation=generation,
            classifier=classifier,
            access_log=access_log,
            max_in_flight=stream_max_in_flight,
        )

    # --- Triton's model repository extension (inferbus_gateway.triton.repository) ---
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
        """Server name, version, extensions; FAILED_PRECONDITION when the client
        expects another stack (`inferbus_common.stackid`: the CLI asks first)."""
        refused = stackid.refusal("gateway", self._service.stack_id, context.invocation_metadata())
        if refused is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
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
            _, response = await infer_one(
                self._service,
                self._classifier,
                request,
                _metadata(context),
                context,
                access_log=self._access_log,
            )
            if response.degraded:
                context.set_trailing_metadata((("x-inferbus-degraded", response.degraded),))
            return response_to_proto(response)

        return await _guard(context, run)

    async def ModelStreamInfer(self, request_iterator, context):
        """Triton's streaming inference (`inferbus_gateway.grpc_api.stream`)."""
        async for response in self._stream.serve(request_iterator, context):
            yield response

    # --- Triton's shared-memory extensions (inferbus_gateway.triton.sharedmemory) ---
    def _shm(self) -> SystemSharedMemory:
        if self._service.shared_memory is None:
            raise Unavailable("system shared memory is not served by this gateway")
        return self._service.shared_memory

    async def SystemSharedMemoryStatus(self, request, context):
        """Registered system shared-memory regions (one, or all of the caller's)."""

        async def run() -> pb.SystemSharedMemoryStatusResponse:
            owner = await self._service.caller(_metadata(context))
            resp = pb.SystemSharedMemoryStatusResponse()
            for region in self._shm().status(owner, request.name):
                resp.regions[str(region["name"])].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return resp

        return await _guard(context, run)

    async def SystemSharedMemoryRegister(self, request, context):
        """Register a region of a POSIX shared-memory object."""

        async def run() -> pb.SystemSharedMemoryRegisterResponse:
            owner = await self._service.caller(_metadata(context))
            self._shm().register(
                owner, request.name, request.key, request.offset, request.byte_size
            )
            return pb.SystemSharedMemoryRegisterResponse()

        return await _guard(context, run)

    async def SystemSharedMemoryUnregister(self, request, context):
        """Unregister a region (every region of the caller when no name is given)."""

        async def run() -> pb.SystemSharedMemoryUnregisterResponse:
            owner = await self._service.caller(_metadata(context))
            self._shm().unregister(owner, request.name)
            return pb.SystemSharedMemoryUnregisterResponse()

        return await _guard(context, run)

    async def CudaSharedMemoryStatus(self, request, context):
        """No CUDA regions are ever registered: an empty status (a named one is unknown)."""

        async def run() -> pb.CudaSharedMemoryStatusResponse:
            await self._service.caller(_metadata(context))
            if request.name:
                raise Unimplemented(CUDA_UNSUPPORTED)
            return pb.CudaSharedMemoryStatusResponse()

        return await _guard(context, run)

    async def CudaSharedMemoryRegister(self, request, context):
        """Refused: CUDA shared memory is not supported (UNIMPLEMENTED, naming the extension)."""

        async def run() -> pb.CudaSharedMemoryRegisterResponse:
            raise Unimplemented(CUDA_UNSUPPORTED)

        return await _guard(context, run)

    async def CudaSharedMemoryUnregister(self, request, context):
        """Nothing to unregister: every call succeeds but a named region, which is unknown."""

        async def run() -> pb.CudaSharedMemoryUnregisterResponse:
            await self._service.caller(_metadata(context))
            if request.name:
                raise Unimplemented(CUDA_UNSUPPORTED)
            return pb.CudaSharedMemoryUnregisterResponse()

        return await _guard(context, run)

    # --- Triton's trace and logging extensions (inferbus_gateway.triton.tracelog) ---
    def _trace(self) -> TraceSettings:
        if self._service.trace is None:
            raise Unavailable("trace settings are not served by this gateway")
        return self._service.trace

    def _logs(self) -> LogSettings:
        if self._service.log_settings is None:
            raise Unavailable("log settings are not served by this gateway")
        return self._service.log_settings

    async def TraceSetting(self, request, context):
        """Read or change the trace settings (global, or of one model)."""

        async def run() -> pb.TraceSettingResponse:
            changes = {k: list(v.value) for k, v in request.settings.items()}
            await self._service.authorize_settings(_metadata(context), change=bool(changes))
            if request.model_name:
                self._service.resolve(request.model_name)
            trace = self._trace()
            doc = trace.update(request.model_name, changes) if changes else None
            doc = doc or trace.get(request.model_name)
            resp = pb.TraceSettingResponse()
            for key, values in doc.items():
                resp.settings[key].value.extend(values)
            return resp

        return await _guard(context, run)

    async def LogSettings(self, request, context):
        """Read or change the log settings."""

        async def run() -> pb.LogSettingsResponse:
            changes = {}
            for key, value in request.settings.items():
                kind = value.WhichOneof("parameter_choice")
                if kind is None:
                    raise InvalidArgument(f"log setting '{key}' has no value")
                changes[key] = getattr(value, kind)
            await self._service.authorize_settings(_metadata(context), change=bool(changes))
            logs = self._logs()
            doc = logs.update(changes) if changes else logs.get()
            resp = pb.LogSettingsResponse()
            for key, value in doc.items():
                resp.settings[key].CopyFrom(_log_value(value))
            return resp

        return await _guard(context, run)
