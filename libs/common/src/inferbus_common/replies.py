"""Building and reading reply messages (any service → gateway inbox).

Two shapes (docs/architecture.md, "Replies"): a request that came in a
request bundle (it has a token) is answered inside a reply bundle to its
gateway's inbox (`inferbus_common.bundles`); a request that came alone is
answered by a single message to its reply subject, OK when it has no
`Ib-Status` header (body: a tensor frame of the outputs), else with
`Ib-Status`, `Ib-Error` and, for RESOURCE_EXHAUSTED, `Ib-Reason`.
`send_errors` answers any mix of both with one error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nats.aio.client import Client

from inferbus_common import headers as h
from inferbus_common.bundles import BundledReply, ReplyGroups
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


@dataclass(frozen=True, slots=True)
class ReplyTarget:
    """Where one request's answer goes.

    Attributes:
        reply: the reply subject (token 0) or the reply-bundle inbox.
        token: the request's token in its gateway's reply bundles (0: none).
        request_id: the request's id (single replies carry it).
    """

    reply: str
    token: int = 0
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
    """Answer requests with one error: a reply bundle per inbox for bundled
    requests, a single reply for each of the others.

    `reason` is sent only with RESOURCE_EXHAUSTED. Requests without a reply
    subject are skipped (nobody is waiting).
    """
    if code is not StatusCode.RESOURCE_EXHAUSTED:
        reason = ""
    groups = ReplyGroups(version, digest)
    for t in targets:
        if not t.reply:
            continue
        if t.token:
            groups.add(t.reply, BundledReply(t.token, code.name, message, reason))
            continue
        headers = {h.STATUS: code.name, h.ERROR: " ".join(message.split())[:1024]}
        if t.request_id:
            headers[h.REQUEST_ID] = t.request_id
        if version:
            headers[h.VERSION] = version
        if digest:
            headers[h.DIGEST] = digest
        if reason:
            headers[h.REASON] = reason
        await nc.publish(t.reply, b"", headers=headers)
    for inbox, payload in groups.messages():
        await nc.publish(inbox, payload)


def error_from_fields(status: str, error: str, reason: str = "") -> InferbusError | None:
    """The typed error of a reply's status, message and reason (None for OK)."""
    if not status or status == StatusCode.OK.name:
        return None
    exc = error_from_status(status, error or "error without a message")
    if isinstance(exc, ResourceExhausted):
        exc.reason = reason
    return exc


def error_from_reply(headers: dict[str, str] | None) -> InferbusError | None:
    """The typed error a single reply's headers carry, or None for an OK reply."""
    if not headers:
        return None
    return error_from_fields(
        headers.get(h.STATUS, ""), headers.get(h.ERROR, ""), headers.get(h.REASON, "")
    )
