"""Building and reading reply messages (any service → gateway inbox).

A reply is OK when it has no `Ib-Status` header; its body is then a tensor
frame of the outputs. An error reply carries `Ib-Status`, `Ib-Error` and, for
RESOURCE_EXHAUSTED, `Ib-Reason`, with an empty body.
"""

from __future__ import annotations

from nats.aio.client import Client

from inferbus_common import headers as h
from inferbus_common.errors import (
    InferbusError,
    ResourceExhausted,
    StatusCode,
    error_from_status,
    status_of,
)


def error_headers(exc: BaseException, request_id: str = "") -> dict[str, str]:
    """Reply headers describing `exc` (client-safe: unknown errors become INTERNAL)."""
    code, message = status_of(exc)
    out = {h.STATUS: code.name, h.ERROR: message}
    if request_id:
        out[h.REQUEST_ID] = request_id
    if isinstance(exc, ResourceExhausted) and exc.reason:
        out[h.REASON] = exc.reason
    return out


async def send_error(nc: Client, subject: str, exc: BaseException, request_id: str = "") -> None:
    """Publish an error reply to `subject` (no-op when there is no reply subject)."""
    if subject:
        await nc.publish(subject, b"", headers=error_headers(exc, request_id))


def error_from_reply(headers: dict[str, str] | None) -> InferbusError | None:
    """The typed error a reply carries, or None for an OK reply."""
    if not headers:
        return None
    status = headers.get(h.STATUS)
    if not status or status == StatusCode.OK.name:
        return None
    exc = error_from_status(status, headers.get(h.ERROR, "error without a message"))
    if isinstance(exc, ResourceExhausted):
        exc.reason = headers.get(h.REASON, "")
    return exc
