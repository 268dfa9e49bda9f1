"""One error hierarchy for every service and every edge.

Each error carries a transport-neutral `StatusCode`. The edges map it: gRPC
status (gateway gRPC), HTTP status (gateway REST), and the `Ib-Status` header on
NATS replies (worker, batcher, router → gateway). Unknown exceptions become
INTERNAL without leaking their text.

Retry guidance (also in docs/architecture.md): UNAVAILABLE and
RESOURCE_EXHAUSTED are safe to retry after a back-off (the request was not
computed); DEADLINE_EXCEEDED may have been computed but no answer was sent, so
retry only idempotent calls; 4xx-style errors (INVALID_ARGUMENT, NOT_FOUND,
UNAUTHENTICATED, PERMISSION_DENIED, FAILED_PRECONDITION) are never worth
retrying unchanged; INTERNAL is not retried automatically.
"""

from __future__ import annotations

import enum


class StatusCode(enum.Enum):
    """Transport-neutral status, with its gRPC name, HTTP code and retry advice."""

    OK = ("OK", 200, False)
    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, False)
    NOT_FOUND = ("NOT_FOUND", 404, False)
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, False)
    PERMISSION_DENIED = ("PERMISSION_DENIED", 403, False)
    FAILED_PRECONDITION = ("FAILED_PRECONDITION", 400, False)
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, True)
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, False)
    UNAVAILABLE = ("UNAVAILABLE", 503, True)
    CANCELLED = ("CANCELLED", 499, False)
    UNIMPLEMENTED = ("UNIMPLEMENTED", 400, False)
    INTERNAL = ("INTERNAL", 500, False)

    def __init__(self, grpc_name: str, http_status: int, retryable: bool) -> None:
        self.grpc_name = grpc_name
        self.http_status = http_status
        self.retryable = retryable

    @classmethod
    def from_name(cls, name: str) -> StatusCode:
        """Look a code up by its name (as carried in `Ib-Status`); unknown → INTERNAL."""
        try:
            return cls[name]
        except KeyError:
            return cls.INTERNAL


class InferbusError(Exception):
    """Base of every error inferbus raises on purpose.

    Args:
        message: text a person can act on; it is returned to the client.
    """

    code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(InferbusError):
    """The request is malformed or does not match the model's metadata."""

    code = StatusCode.INVALID_ARGUMENT


class NotFound(InferbusError):
    """The model, version or file does not exist."""

    code = StatusCode.NOT_FOUND


class Unauthenticated(InferbusError):
    """No credentials, or credentials that are not valid."""

    code = StatusCode.UNAUTHENTICATED


class PermissionDenied(InferbusError):
    """Valid credentials that are not allowed to do this."""

    code = StatusCode.PERMISSION_DENIED


class FailedPrecondition(InferbusError):
    """The system is not in a state that allows the operation (e.g. alias points at it)."""

    code = StatusCode.FAILED_PRECONDITION


class ResourceExhausted(InferbusError):
    """A queue, limit or quota is full; the request was not computed.

    Args:
        message: what was full.
        reason: machine-readable strategy, e.g. ``queue-full`` or ``cluster-qps``.
        retry_after_s: a hint for clients, in seconds.
    """

    code = StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, reason: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class DeadlineExceeded(InferbusError):
    """The request's deadline passed before an answer was ready."""

    code = StatusCode.DEADLINE_EXCEEDED


class Unavailable(InferbusError):
    """No healthy component can take the request right now."""

    code = StatusCode.UNAVAILABLE


class Cancelled(InferbusError):
    """The client went away or the request was cancelled."""

    code = StatusCode.CANCELLED


class Unimplemented(InferbusError):
    """A protocol feature or extension this server does not implement (HTTP 400, as
    Triton answers unsupported extensions)."""

    code = StatusCode.UNIMPLEMENTED


class Internal(InferbusError):
    """A bug or an unexpected failure; details are in the logs, not the message."""

    code = StatusCode.INTERNAL


_BY_CODE: dict[StatusCode, type[InferbusError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Unauthenticated,
        PermissionDenied,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Cancelled,
        Unimplemented,
        Internal,
    )
}


def error_from_status(code: StatusCode | str, message: str) -> InferbusError:
    """Rebuild a typed error from a status code received over the bus."""
    if isinstance(code, str):
        code = StatusCode.from_name(code)
    cls = _BY_CODE.get(code, Internal)
    return cls(message)


def status_of(exc: BaseException) -> tuple[StatusCode, str]:
    """Status and client-safe message for any exception.

    Inferbus errors keep their code and message; anything else is INTERNAL with
    a generic message, so internals never leak to clients.
    """
    if isinstance(exc, InferbusError):
        return exc.code, exc.message
    return StatusCode.INTERNAL, "internal error (see service logs)"
