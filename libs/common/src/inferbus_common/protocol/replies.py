"""Answering requests, and reading answers (any service → gateway inbox).

Every tensor request travels in a request bundle, so every answer travels in
a reply bundle to its gateway's inbox (`inferbus_common.protocol.bundles`):
`send_errors` answers any set of requests with one error, one reply bundle
per inbox. Streams (generative requests on ``ib.gen``) answer chunk by chunk
with headers instead: `error_headers` and `send_error` build those. Every
error text passes `framing.one_line` (one line, at most 1,024 characters).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nats.aio.client import Client

from inferbus_common.errors import (
    InferbusError,
    ResourceExhausted,
    StatusCode,
    error_from_status,
    status_of,
)
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import BundledReply, ReplyGroups
from inferbus_common.protocol.framing import one_line


def error_headers(exc: BaseException, request_id: str = "") -> dict[str, str]:
    """Headers of a streamed reply describing `exc` (client-safe: unknown errors
    become INTERNAL; the message is one line of at most 1,024 characters)."""
    code, message = status_of(exc)
    out = {h.STATUS: code.name, h.ERROR: one_line(message)}
    if request_id:
        out[h.REQUEST_ID] = request_id
    if isinstance(exc, ResourceExhausted):
        if exc.reason:
            out[h.REASON] = one_line(exc.reason)
        out[h.RETRY_AFTER] = f"{exc.retry_after_s:.3f}"
    return out


async def send_error(nc: Client, subject: str, exc: BaseException, request_id: str = "") -> None:
    """Publish a streamed request's error reply to `subject` (no-op without one)."""
    if subject:
        await nc.publish(subject, b"", headers=error_headers(exc, request_id))


@dataclass(frozen=True, slots=True)
class ReplyTarget:
    """Where one request's answer goes.

    Attributes:
        inbox: the gateway inbox its reply bundle goes to ('' = nobody waits).
        token: the request's token in that gateway's reply bundles.
        request_id: the request's id (for logs).
    """

    inbox: str
    token: int
    request_id: str = ""


async def send_errors(
    nc: Client,
    targets: Iterable[ReplyTarget],
    code: StatusCode,
    message: str,
    *,
    reason: str = "",
    version: str = "",
    digest: str = "",
) -> None:
    """Answer requests with one error: one reply bundle per inbox.

    `reason` is sent only with RESOURCE_EXHAUSTED. Targets without an inbox
    are skipped (nobody is waiting).
    """
    if code is not StatusCode.RESOURCE_EXHAUSTED:
        reason = ""
    groups = ReplyGroups(version, digest)
    for t in targets:
        if t.inbox:
            groups.add(t.inbox, BundledReply(t.token, code.name, message, reason))
    for inbox, payload in groups.messages():
        await nc.publish(inbox, payload)


def error_from_fields(
    status: str, error: str, reason: str = "", retry_after: str = ""
) -> InferbusError | None:
    """The typed error of a reply's status, message, reason and retry hint (None for OK)."""
    if not status or status == StatusCode.OK.name:
        return None
    exc = error_from_status(status, error or "error without a message")
    if isinstance(exc, ResourceExhausted):
        exc.reason = reason
        try:
            if retry_after:
                exc.retry_after_s = max(0.001, min(float(retry_after), 86_400.0))
        except ValueError:
            pass  # a hint only: the default stands
    return exc


def error_from_reply(headers: dict[str, str] | None) -> InferbusError | None:
    """The typed error a streamed reply's (or a sequence reply's) headers carry,
    or None for an OK reply."""
    if not headers:
        return None
    return error_from_fields(
        headers.get(h.STATUS, ""),
        headers.get(h.ERROR, ""),
        headers.get(h.REASON, ""),
        headers.get(h.RETRY_AFTER, ""),
    )
