"""Bearer tokens on internal gRPC APIs (the registry's).

The registry API changes what the platform serves (push, aliases, routes,
rollouts), so when tokens are configured it demands one on every call, in the
``x-inferbus-token`` metadata key. (Not ``authorization``: clients such as the
CLI also talk to the gateway, whose ``authorization`` carries tenants' API
keys and JWTs; the two must never be mixed up.)

Two kinds of token: a *reader* token (workers downloading artifacts, the
gateway reading versions) and an *admin* token (everything). `TokenGuard` is
the server side; `channel` / `aio_channel` add the token on the client side.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from inferbus_common.secretfile import read_secret

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

__all__ = [
    "METADATA_KEY",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "TokenGuard",
    "aio_channel",
    "channel",
    "read_secret",
    "token_from_env",
]

METADATA_KEY = "x-inferbus-token"
"""gRPC metadata key carrying the token."""

TOKEN_ENV = "INFERBUS_REGISTRY_TOKEN"
TOKEN_FILE_ENV = "INFERBUS_REGISTRY_TOKEN_FILE"


def token_from_env() -> str | None:
    """The CLI's registry token: from ``$INFERBUS_REGISTRY_TOKEN_FILE`` or ``..._TOKEN``."""
    path = os.environ.get(TOKEN_FILE_ENV)
    return read_secret(os.environ.get(TOKEN_ENV), Path(path) if path else None)


# --- client side ----------------------------------------------------------------
def _with_token(details: Any, token: str) -> Any:
    metadata = list(details.metadata or [])
    metadata.append((METADATA_KEY, token))
    return details._replace(metadata=metadata)


class _SyncInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(_with_token(details, self._token), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, iterator: Any
    ) -> Any:
        return continuation(_with_token(details, self._token), iterator)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, iterator: Any
    ) -> Any:
        return continuation(_with_token(details, self._token), iterator)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(
        self,
        continuation: Callable[..., Any],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(
        self,
        continuation: Callable[..., Any],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        details: grpc.aio.ClientCallDetails,
        iterator: Any,
    ) -> Any:
        return await continuation(_with_token(details, self._token), iterator)


def channel(
    target: str, token: str | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel that sends `token` on every call (plain channel when None)."""
    ch = grpc.insecure_channel(target, options=list(options))
    if token:
        ch = grpc.intercept_channel(ch, _SyncInterceptor(token))
    return ch


def aio_channel(
    target: str, token: str | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel that sends `token` on every call (plain channel when None)."""
    interceptors = (
        [_AioUnaryUnary(token), _AioUnaryStream(token), _AioStreamUnary(token)] if token else None
    )
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)


# --- server side ----------------------------------------------------------------
class TokenGuard(grpc.aio.ServerInterceptor):
    """Refuse calls without a valid token (UNAUTHENTICATED) or with a reader token on a
    method that needs admin (PERMISSION_DENIED).

    Args:
        admin_token: allows every method.
        reader_token: allows only `read_methods`.
        read_methods: method names (the last part of the gRPC path) a reader may call.
        service: name shown in error messages.

    With no token configured at all, every call is allowed (open mode).
    """

    def __init__(
        self,
        *,
        admin_token: str | None,
        reader_token: str | None,
        read_methods: frozenset[str],
        service: str = "registry",
    ) -> None:
        self._admin = (admin_token or "").encode()
        self._reader = (reader_token or "").encode()
        self._read_methods = read_methods
        self._service = service

    @property
    def enabled(self) -> bool:
        """Whether any token is required."""
        return bool(self._admin or self._reader)

    def check(self, method: str, token: str | None) -> tuple[grpc.StatusCode, str] | None:
        """Why a call to `method` with `token` is refused, or None when allowed."""
        if not self.enabled:
            return None
        given = (token or "").encode()
        if self._admin and hmac.compare_digest(given, self._admin):
            return None
        if self._reader and hmac.compare_digest(given, self._reader):
            if method in self._read_methods:
                return None
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs the {self._service}'s admin token; the token given is "
                "a reader token",
            )
        if not token:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"the {self._service} requires a token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
                f"(sent as '{METADATA_KEY}' metadata)",
            )
        return grpc.StatusCode.UNAUTHENTICATED, f"the {self._service} token is not valid"

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = await continuation(handler_call_details)
        if not self.enabled or handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        token = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY)
        # Only ``-bin`` metadata keys carry bytes; a token key never does.
        refusal = self.check(method, token if isinstance(token, str) else None)
        if refusal is None:
            return handler
        code, message = refusal
        return _refusing_handler(handler, code, message)


def _refusing_handler(
    handler: grpc.RpcMethodHandler[_Req, _Resp], code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that aborts with `code`."""

    async def abort(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    async def abort_stream(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    decode, encode = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, decode, encode)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, decode, encode)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, decode, encode)
    return grpc.stream_stream_rpc_method_handler(abort_stream, decode, encode)
