"""Register the KServe V2 servicer so that undecodable requests are the client's error.

The generated ``add_GRPCInferenceServiceServicer_to_server`` parses each
request with ``FromString``; when the bytes are not a valid protobuf message
(truncated, corrupted, a string field that is not UTF-8), grpc-python answers
UNKNOWN ("Unexpected DecodeError") or INTERNAL: a server error for a client's
mistake, which also counts against the model's error budget in dashboards.
Here every method parses with a deserializer that never raises; a request
that did not parse is answered INVALID_ARGUMENT before the servicer sees it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from inferbus_common.errors import InvalidArgument
from inferbus_proto.v2 import grpc_predict_v2_pb2 as pb

SERVICE = "inference.GRPCInferenceService"


class Undecodable:
    """Stands in for a request whose bytes are not a valid message."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    def message(self) -> str:
        """What the client is told."""
        return (
            f"the request is not a valid {self.type_name} protobuf message "
            f"({self.error[:200]}); check the client's serialization"
        )

    def error_for_client(self) -> InvalidArgument:
        """The INVALID_ARGUMENT error a stream answers such a message with."""
        return InvalidArgument(self.message())


def _tolerant(cls: type[Message]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc))

    return deserialize


def _guarded(
    impl: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        return await impl(request, context)

    return handler


def _methods() -> Any:
    return pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name.items()


def unary_methods(
    servicer: Any,
) -> dict[str, tuple[Callable[[bytes], Any], Callable[[Any, Any], Awaitable[Any]]]]:
    """Each unary method of `SERVICE` by name: its tolerant request parser and the
    servicer's handler, guarded so an undecodable request is INVALID_ARGUMENT."""
    return {
        name: (_tolerant(getattr(pb, method.input_type.name)), _guarded(getattr(servicer, name)))
        for name, method in _methods()
        if not (method.client_streaming or method.server_streaming)
    }


def add_servicer_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every method of `SERVICE` on `server`, answering undecodable requests
    INVALID_ARGUMENT (a drop-in for the generated ``add_..._to_server``)."""
    handlers = {}
    unary = unary_methods(servicer)
    for name, method in _methods():
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        if name not in unary:
            # Stream items that do not parse reach the handler as `Undecodable`
            # and are answered with an error message on the stream.
            handlers[name] = grpc.stream_stream_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=_tolerant(request_cls),
                response_serializer=response_cls.SerializeToString,
            )
            continue
        deserialize, handler = unary[name]
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            handler,
            request_deserializer=deserialize,
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
