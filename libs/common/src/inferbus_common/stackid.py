"""Which stack a client means: the stack id check of the registry and the gateway.

`inferbus up` gives each stack an id (``<home>/state.json``, and the
registry's and gateway's ``STACK_ID`` settings). A CLI command that reaches the
stack through its state file sends that id in the ``x-inferbus-stack``
metadata key; a registry or gateway with another id (or none) refuses the call
with FAILED_PRECONDITION, so a push or a readiness check aimed at one stack
never lands in another that happens to hold its ports (the first one gone, a
second stack started on the same ports). Calls without the key are served as
before.

The registry checks every call (`StackGuard`); the gateway checks only
ServerMetadata (`check_metadata`), which the CLI calls first, so the inference
path pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc

from inferbus_common.grpcauth import _refusing_handler

__all__ = ["METADATA_KEY", "StackGuard", "expecting", "mismatch", "refusal"]

METADATA_KEY = "x-inferbus-stack"
"""gRPC metadata key carrying the stack id the client expects."""


def mismatch(service: str, own: str, expected: str) -> str:
    """The refusal's message."""
    theirs = f"stack {own}" if own else "a stack with no id (not started by this `inferbus up`)"
    return (
        f"this {service} belongs to {theirs}, not to stack {expected} that the state file "
        "names: another stack holds its address (check the ports, or the --home / "
        "--registry / --url you meant)"
    )


def refusal(service: str, own: str, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The refusal message when `metadata` expects another stack than `own`, else None."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            expected = value.decode() if isinstance(value, bytes) else str(value)
            return None if expected == own else mismatch(service, own, expected)
    return None


class StackGuard(grpc.aio.ServerInterceptor):
    """Refuse (FAILED_PRECONDITION) a call that expects another stack than this one's.

    Args:
        stack_id: this server's stack id ("" when it was started without one).
        service: name shown in the message (``registry``).
    """

    def __init__(self, stack_id: str, service: str) -> None:
        self.stack_id = stack_id
        self.service = service

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        message = refusal(self.service, self.stack_id, handler_call_details.invocation_metadata)
        if message is None:
            return handler
        return _refusing_handler(handler, grpc.StatusCode.FAILED_PRECONDITION, message)


class _Expecting(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, stack_id: str) -> None:
        self._pair = (METADATA_KEY, stack_id)

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or []), self._pair])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, iterator: Any) -> Any:
        return continuation(self._details(details), iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, iterator: Any) -> Any:
        return continuation(self._details(details), iterator)


def expecting(channel: grpc.Channel, stack_id: str) -> grpc.Channel:
    """`channel`, sending `stack_id` as the expected stack on every call ("" : as is)."""
    if not stack_id:
        return channel
    return grpc.intercept_channel(channel, _Expecting(stack_id))
