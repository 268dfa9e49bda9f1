"""The registry's gRPC server takes messages up to `grpc_max_message_bytes`, not 4 MiB."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from inferbus_common.registrychannel import registry_channel
from inferbus_proto.registry import registry_pb2
from inferbus_registry.app import RegistryApp

_LIST_MODELS = "/inferbus.registry.v1.Registry/ListModels"


def _padded_list_models_request(padding: int) -> bytes:
    """A ListModelsRequest (no fields) of about `padding` bytes: a FileChunk's bytes
    field on the wire, which the server parses as an unknown field and ignores."""
    return registry_pb2.FileChunk(data=b"\0" * padding).SerializeToString()


async def _list_models(app: RegistryApp, padding: int) -> registry_pb2.ListModelsResponse:
    async with registry_channel(f"127.0.0.1:{app.grpc_port}", None) as channel:
        call = channel.unary_unary(
            _LIST_MODELS,
            request_serializer=None,
            response_deserializer=registry_pb2.ListModelsResponse.FromString,
        )
        return await call(_padded_list_models_request(padding), timeout=10)


async def test_messages_past_grpc_default_and_up_to_the_setting(
    start_registry: Callable[..., RegistryApp],
) -> None:
    async with start_registry(grpc_max_message_bytes=16 << 20) as app:
        # Past gRPC's 4 MiB default: accepted.
        assert list((await _list_models(app, 6 << 20)).models) == []
        # Past the configured limit: refused by the server.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _list_models(app, 17 << 20)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
