"""The stack id check (`inferbus_common.stackid`) against a real gRPC server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inferbus_common import stackid

_METHOD = "/test.Echo/Say"


def test_refusal_names_both_stacks_and_ignores_calls_that_expect_none() -> None:
    assert stackid.refusal("registry", "aaa", None) is None
    assert stackid.refusal("registry", "aaa", [("other", "x")]) is None
    assert stackid.refusal("registry", "aaa", [(stackid.METADATA_KEY, "aaa")]) is None
    message = stackid.refusal("registry", "aaa", [(stackid.METADATA_KEY, "bbb")])
    assert message is not None
    assert "registry belongs to stack aaa, not to stack bbb" in message
    unnamed = stackid.refusal("gateway", "", [(stackid.METADATA_KEY, "bbb")])
    assert unnamed is not None and "no id" in unnamed


async def test_guard_refuses_a_client_expecting_another_stack() -> None:
    async def say(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return b"served:" + request

    server = grpc.aio.server(interceptors=[stackid.StackGuard("aaa", "registry")])
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"

        def call(stack: str) -> bytes:
            with stackid.expecting(grpc.insecure_channel(address), stack) as channel:
                result: bytes = channel.unary_unary(_METHOD)(b"x", timeout=10)
                return result

        assert await asyncio.to_thread(call, "") == b"served:x"
        assert await asyncio.to_thread(call, "aaa") == b"served:x"
        with pytest.raises(grpc.RpcError) as refused:
            await asyncio.to_thread(call, "bbb")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not to stack bbb" in (refused.value.details() or "")
    finally:
        await server.stop(None)
