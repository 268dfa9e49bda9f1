"""gRPC plumbing shared by the commands: channels, stubs and error text."""

from __future__ import annotations

from typing import overload

import grpc

from inferbus_common import grpcauth, stackid
from inferbus_common.registrychannel import message_size_options
from inferbus_proto.registry import registry_pb2_grpc
from inferbus_proto.v2 import grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc

#: Largest message accepted or sent (matches the gateway's default limit).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def open_channel(address: str, token: str | None = None, stack_id: str = "") -> grpc.Channel:
    """An insecure channel to ``HOST:PORT`` with large message limits.

    Args:
        address: ``HOST:PORT``.
        token: registry token sent on every call (see `registry_channel`).
        stack_id: the stack every call must reach (`inferbus_common.stackid`;
            `inferbus_cli.state.expected_stack`); "" for no check.
    """
    channel = grpcauth.channel(address, token, options=message_size_options(MAX_MESSAGE_BYTES))
    return stackid.expecting(channel, stack_id)


def registry_channel(address: str, stack_id: str = "") -> grpc.Channel:
    """A channel to the registry carrying its token from ``$INFERBUS_REGISTRY_TOKEN_FILE``
    or ``$INFERBUS_REGISTRY_TOKEN`` (none: the registry must be open), and the stack
    it must belong to (the registry refuses every call otherwise)."""
    return open_channel(address, grpcauth.token_from_env(), stack_id)


def check_gateway_stack(channel: grpc.Channel, stack_id: str, timeout_s: float = 10.0) -> None:
    """Ask the gateway on `channel` (opened with `stack_id`) whether it belongs to
    that stack: ServerMetadata fails with FAILED_PRECONDITION when it does not.

    Raises:
        grpc.RpcError: the gateway belongs to another stack, or did not answer.
    """
    if stack_id:
        inference_stub(channel).ServerMetadata(
            grpc_predict_v2_pb2.ServerMetadataRequest(), timeout=timeout_s
        )


def registry_stub(channel: grpc.Channel) -> registry_pb2_grpc.RegistryStub:
    """Stub of the inferbus registry API."""
    return registry_pb2_grpc.RegistryStub(channel)


@overload
def inference_stub(
    channel: grpc.aio.Channel,
) -> grpc_predict_v2_pb2_grpc.GRPCInferenceServiceAsyncStub: ...
@overload
def inference_stub(channel: grpc.Channel) -> grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub: ...
def inference_stub(
    channel: grpc.Channel | grpc.aio.Channel,
) -> grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub:
    """Stub of the KServe V2 inference API (the gateway); asyncio's for an aio channel."""
    return grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel)


def rpc_error_text(exc: grpc.RpcError, address: str) -> str:
    """``UNAVAILABLE: <details> (127.0.0.1:8001)``: the status name and message."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    name = code.name if code is not None else "UNKNOWN"
    return f"{name}: {details} ({address})"
