"""Connecting to NATS and creating the JetStream objects the platform uses."""

from __future__ import annotations

import logging

import nats
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)


async def connect(url: str, name: str, *, connect_timeout: float = 5.0) -> Client:
    """Connect to NATS with reconnects forever (a platform service never gives up)."""

    async def _disconnected() -> None:
        log.warning("nats disconnected", extra={"nats_url": url})

    async def _reconnected() -> None:
        log.info("nats reconnected", extra={"nats_url": url})

    async def _error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    return await nats.connect(
        url,
        name=name,
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        disconnected_cb=_disconnected,
        reconnected_cb=_reconnected,
        error_cb=_error,
        pending_size=64 * 1024 * 1024,
    )


async def ensure_batch_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    storage: str = "memory",
    max_bytes: int = 1 << 30,
    max_msgs: int = 1_000_000,
) -> None:
    """Create the micro-batch work-queue stream if it does not exist.

    Work-queue retention deletes a message once a consumer acks it; new
    messages are refused (not old ones dropped) when the stream is full, so the
    batcher sees the overload and answers it.
    """
    config = StreamConfig(
        name=subjects.batch_stream,
        subjects=[subjects.batch_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.MEMORY if storage == "memory" else StorageType.FILE,
        discard=DiscardPolicy.NEW,
        max_bytes=max_bytes,
        max_msgs=max_msgs,
        duplicate_window=120.0,
    )
    try:
        await js.stream_info(subjects.batch_stream)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            # Another service created it between our check and our create.
            await js.stream_info(subjects.batch_stream)
