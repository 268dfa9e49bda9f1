"""The audit stream (``<PREFIX>_AUDIT``): creating it and reading captured payloads back.

The stream holds every subject under ``<prefix>.audit.>``: the small JSON
`AuditRecord` of each answered request (``<prefix>.audit.<model>``) and, with
payload capture on, the captured tensors (``<prefix>.audit.payload.<model>.<version>``,
`inferbus_common.capture`). It is a limits stream that discards the oldest
messages: an audit trail must never refuse (and so slow or fail) a request;
its retention is bounded by age and size instead.

Whichever service needs it first creates it (`ensure_audit_stream` is
idempotent); a later call with other limits updates them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from inferbus_common.bus import replicas_of
from inferbus_common.capture import CapturedRequest, decode_capture
from inferbus_common.protocol.framing import FrameError
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)


def audit_stream_config(
    subjects: Subjects,
    *,
    max_age_s: float,
    max_bytes: int,
    storage: str = "file",
    max_msg_bytes: int = -1,
    replicas: int = 1,
) -> StreamConfig:
    """The audit stream's configuration (limits retention, oldest discarded first)."""
    return StreamConfig(
        name=subjects.audit_stream,
        subjects=[subjects.audit_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY if storage == "memory" else StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        max_msg_size=max_msg_bytes,
        # The server refuses a duplicate window longer than the retention.
        duplicate_window=min(120.0, max_age_s) if max_age_s > 0 else 120.0,
        num_replicas=replicas,
    )


async def ensure_audit_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    max_age_s: float = 7 * 24 * 3600.0,
    max_bytes: int = 1 << 30,
    storage: str = "file",
    max_msg_bytes: int = -1,
) -> None:
    """Create the audit stream, or bring its retention limits to these values.

    It gets the replica count of the connection (`inferbus_common.bus.replicas_of`);
    an existing stream with fewer replicas is raised to it.

    Args:
        js: JetStream context.
        subjects: naming scheme.
        max_age_s: messages older than this are removed (0 = no age limit).
        max_bytes: the stream's size bound; the oldest messages go first (-1 = none).
        storage: ``file`` (survives a NATS restart) or ``memory``.
        max_msg_bytes: largest message accepted (-1 = the server's limit).
    """
    config = audit_stream_config(
        subjects,
        max_age_s=max_age_s,
        max_bytes=max_bytes,
        storage=storage,
        max_msg_bytes=max_msg_bytes,
        replicas=replicas_of(js),
    )
    try:
        info = await js.stream_info(subjects.audit_stream)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
            log.info("audit stream %s created", subjects.audit_stream)
            return
        except nats.js.errors.BadRequestError:
            # Another service created it between our check and our create.
            info = await js.stream_info(subjects.audit_stream)
    current = info.config
    if (
        (current.max_age or 0) != (config.max_age or 0)
        or current.max_bytes != config.max_bytes
        or current.max_msg_size != config.max_msg_size
        or (current.num_replicas or 1) < (config.num_replicas or 1)
    ):
        current.max_age = config.max_age
        current.max_bytes = config.max_bytes
        current.max_msg_size = config.max_msg_size
        current.num_replicas = max(current.num_replicas or 1, config.num_replicas or 1)
        current.duplicate_window = config.duplicate_window
        await js.update_stream(current)
        log.info("audit stream %s limits updated", subjects.audit_stream)


async def read_captures(
    js: JetStreamContext,
    subjects: Subjects,
    model: str,
    version: str,
    *,
    since_unix_s: float,
    limit: int | None = None,
    batch: int = 256,
    fetch_timeout_s: float = 2.0,
) -> AsyncIterator[CapturedRequest]:
    """Captured requests of one model version, oldest first, from `since_unix_s` on.

    Reads with an ephemeral pull consumer (no acks) until the stream has
    nothing more for the version, or `limit` requests were yielded. Messages
    that are not captures are skipped with a warning.

    Raises:
        nats.js.errors.NotFoundError: the audit stream does not exist.
    """
    await js.stream_info(subjects.audit_stream)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        # nats-py sends a datetime as RFC 3339 UTC text.
        opt_start_time=datetime.fromtimestamp(since_unix_s, UTC),
        ack_policy=AckPolicy.NONE,
        inactive_threshold=60.0,
        mem_storage=True,
    )
    sub = await js.pull_subscribe(
        subjects.audit_payload(model, version), stream=subjects.audit_stream, config=config
    )
    yielded = 0
    try:
        while limit is None or yielded < limit:
            want = batch if limit is None else min(batch, limit - yielded)
            try:
                msgs = await sub.fetch(want, timeout=fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                return
            pending = 0
            for msg in msgs:
                pending = msg.metadata.num_pending
                try:
                    captured = decode_capture(msg.data)
                except FrameError as exc:
                    log.warning("skipping a malformed capture on %s: %s", msg.subject, exc)
                    continue
                yield captured
                yielded += 1
                if limit is not None and yielded >= limit:
                    return
            if pending == 0:
                return
    finally:
        try:
            async with asyncio.timeout(2.0):
                await sub.unsubscribe()
        except (TimeoutError, nats.errors.Error):
            log.debug("ephemeral capture consumer not unsubscribed; it expires by itself")
