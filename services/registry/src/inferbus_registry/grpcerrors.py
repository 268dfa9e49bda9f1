"""How every registry RPC answers a failure: a typed `InferbusError` becomes its gRPC
status with its message, a NATS failure UNAVAILABLE (retry), anything else is
logged and answered INTERNAL without its details (docs/architecture.md,
"Errors and retries")."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc
import nats.errors
import nats.js.errors

from inferbus_common.errors import InferbusError, Internal, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

NATS_ERRORS: tuple[type[Exception], ...] = (nats.errors.Error, nats.js.errors.Error, TimeoutError)
"""Failures of NATS calls: the bus is down or slow, the request may be retried."""


def as_error(exc: Exception, what: str) -> InferbusError:
    """The error an RPC named `what` answers for `exc`."""
    if isinstance(exc, InferbusError):
        return exc
    if isinstance(exc, NATS_ERRORS):
        return Unavailable(f"{what}: NATS is unreachable or slow ({type(exc).__name__}); retry")
    log.error("%s failed", what, exc_info=exc)
    return Internal(f"{what} failed: internal error (see registry logs)")


async def abort(context: grpc.aio.ServicerContext, err: InferbusError) -> NoReturn:
    """End the RPC with `err`'s status and message."""
    await context.abort(grpc.StatusCode[err.code.grpc_name], err.message)
    raise AssertionError("unreachable: context.abort raises")


async def answer(
    context: grpc.aio.ServicerContext, what: str, call: Callable[[], Awaitable[T]]
) -> T:
    """Run one RPC's work; a failure ends the call as `as_error` says."""
    try:
        return await call()
    except Exception as exc:
        err = as_error(exc, what)
    await abort(context, err)
