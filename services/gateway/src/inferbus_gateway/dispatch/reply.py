"""`Reply`: one request's answer as the gateway's dispatch hands it to its caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.msg import Msg

from inferbus_common.codec import Buffer
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.replies import error_from_fields


@dataclass(slots=True, eq=False)
class Reply:
    """One request's answer (from a reply bundle, or a sequence worker's reply).

    Attributes:
        status: a `StatusCode` name ('' = OK).
        error: the error message ('' when OK).
        reason: on RESOURCE_EXHAUSTED, which limit or queue was full.
        version: the version that answered ('' when unknown).
        digest: the artifact digest of that version.
        timings_ms: stage timings reported by the platform (queue, compute, ...).
        frame: the outputs as a tensor frame (empty on error).
    """

    status: str
    error: str = ""
    reason: str = ""
    version: str = ""
    digest: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)
    frame: Buffer = b""

    def raise_for_status(self) -> None:
        """Raise the typed error this reply carries (nothing for OK)."""
        err = error_from_fields(self.status, self.error, self.reason)
        if err is not None:
            raise err

    @classmethod
    def from_msg(cls, msg: Msg) -> Reply:
        """A sequence worker's reply (headers + body, ``ib.seq`` subjects only:
        requests of a sequence go to the one worker holding it, not in bundles)."""
        hdrs = msg.headers or {}
        return cls(
            hdrs.get(h.STATUS, ""),
            hdrs.get(h.ERROR, ""),
            hdrs.get(h.REASON, ""),
            hdrs.get(h.VERSION, ""),
            hdrs.get(h.DIGEST, ""),
            h.parse_timings(hdrs.get(h.TIMINGS)),
            msg.data,
        )
