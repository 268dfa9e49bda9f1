"""Reading a worker's (or batcher's, router's) reply bundles in tests, one answer at a time.

Every tensor request is answered inside a reply bundle (``IBR1``) sent to its
inbox; tests that send micro-batches or bundles and check what came back read
each answer through `answers_of`, with the fields a person checks spelled as
the internal headers (`Ib-Status` absent = OK).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.msg import Msg

from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import decode_reply_bundle


@dataclass
class Answer:
    """One answer of a reply bundle.

    Attributes:
        subject: the inbox it came to.
        token: the request's token.
        headers: ``Ib-Version``, ``Ib-Digest``, ``Ib-Timings`` (this answer's
            queue time and the bundle's shared timings), ``Ib-Batch-Size``, and
            ``Ib-Status``/``Ib-Error``/``Ib-Reason`` for an error.
        data: the outputs' tensor frame (empty for an error).
    """

    subject: str
    token: int
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes = b""


def answers_of(msg: Msg) -> list[Answer]:
    """The answers in a reply bundle message."""
    bundle = decode_reply_bundle(msg.data)
    shared = h.parse_timings(bundle.timings)
    out = []
    for r in bundle.replies:
        headers = {h.VERSION: bundle.version, h.DIGEST: bundle.digest}
        if bundle.batch_rows:
            headers[h.BATCH_SIZE] = str(bundle.batch_rows)
            headers[h.TIMINGS] = h.format_timings({"queue": r.queue_ms, **shared})
        if r.status:
            headers[h.STATUS] = r.status
            headers[h.ERROR] = r.error
            if r.reason:
                headers[h.REASON] = r.reason
        out.append(Answer(msg.subject, r.token, headers, bytes(r.frame)))
    return out
