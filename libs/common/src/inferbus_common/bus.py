"""Connecting to NATS and creating the JetStream objects the platform uses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from inferbus_common import security
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)


NO_STREAM_ERRORS: tuple[type[Exception], ...] = (
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
)
"""What a JetStream or KV call raises when its stream is gone (a NATS server that lost
its state): re-create it and try again."""


def is_no_responders(msg: Msg) -> bool:
    """Whether `msg` is nats-server's "no responders" status (503, empty body): nothing
    was subscribed to the subject a request was published on, so nothing got it.

    nats-server sends it only to a publisher subscribed to the reply subject; the
    callers put their own inbox there (see docs/architecture.md, "Reliability").
    """
    return not msg.data and (msg.headers or {}).get("Status") == "503"


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout: float = 5.0,
    user: str = "",
    password: str = "",
    user_credentials: str = "",
    tls_ca_file: str = "",
) -> Client:
    """Connect to NATS with reconnects forever (a platform service never gives up).

    Args:
        url: server URL(s); ``tls://`` for TLS.
        name: connection name shown by the server.
        user, password: NATS user (its inbox prefix becomes ``_INBOX_<user>``,
            which the broker lets only that user read; see `security`).
        user_credentials: NKEY/JWT credentials file, instead of user and password.
        tls_ca_file: CA bundle for a ``tls://`` server.
    """

    async def _disconnected() -> None:
        log.warning("nats disconnected", extra={"nats_url": url})

    async def _reconnected() -> None:
        log.info("nats reconnected", extra={"nats_url": url})

    async def _error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    extra: dict[str, object] = {}
    if user:
        extra.update(user=user, password=password, inbox_prefix=security.inbox_prefix(user))
    if user_credentials:
        extra["user_credentials"] = user_credentials
    if tls_ca_file or url.startswith("tls://"):
        extra["tls"] = ssl.create_default_context(cafile=tls_ca_file or None)

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
        **extra,
    )


async def ensure_batch_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    storage: str = "memory",
    max_bytes: int = 1 << 30,
    max_msgs: int = 1_000_000,
    max_msgs_per_subject: int = 1024,
    reconcile: bool = False,
) -> None:
    """Create the micro-batch work-queue stream if it does not exist.

    Work-queue retention deletes a message once a consumer acks it; new
    messages are refused (not old ones dropped) when the stream is full, so the
    batcher sees the overload and answers it. The per-subject bound (one
    subject per pool/model/version) keeps one model's backlog from filling the
    stream for everyone: its own batches are refused first.

    The batchers own the stream's limits (``reconcile=True``): whoever created
    it (a worker that started first creates it with the defaults), a batcher
    sets ``max_bytes`` and ``max_msgs_per_subject`` to its own settings. Storage cannot change in
    place; a mismatch is logged with what to do.
    """
    config = StreamConfig(
        name=subjects.batch_stream,
        subjects=[subjects.batch_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.MEMORY if storage == "memory" else StorageType.FILE,
        discard=DiscardPolicy.NEW,
        max_bytes=max_bytes,
        max_msgs=max_msgs,
        max_msgs_per_subject=max_msgs_per_subject,
        discard_new_per_subject=True,
        duplicate_window=120.0,
    )
    try:
        info = await js.stream_info(subjects.batch_stream)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
            return
        except nats.js.errors.BadRequestError:
            # Another service created it between our check and our create.
            info = await js.stream_info(subjects.batch_stream)
    if not reconcile:
        return
    have = info.config
    if have.storage != config.storage:
        log.error(
            "the work-queue stream %s has %s storage but this batcher is set to %s; it "
            "cannot change in place: with no batches waiting, delete the stream "
            "(`nats stream rm %s`) and restart the batchers to recreate it",
            subjects.batch_stream,
            getattr(have.storage, "value", have.storage),
            storage,
            subjects.batch_stream,
        )
    # The bounds the batcher has settings for; others (max_msgs) are left as found.
    if (have.max_bytes, have.max_msgs_per_subject) != (max_bytes, max_msgs_per_subject):
        have.max_bytes = max_bytes
        have.max_msgs_per_subject = max_msgs_per_subject
        await js.update_stream(have)
        log.info(
            "work-queue stream %s limits set to max_bytes=%d max_msgs_per_subject=%d",
            subjects.batch_stream,
            max_bytes,
            max_msgs_per_subject,
        )


async def shutdown(nc: Client, timeout_s: float = 5.0) -> None:
    """Drain a connection, but never wait longer than `timeout_s`.

    `drain` flushes through the server; with the server gone the client keeps
    reconnecting and `drain` would wait forever, so a SIGTERM would never end
    the process. After the timeout the connection is closed without flushing.
    """
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.drain(), timeout_s)
    except (TimeoutError, nats.errors.Error, RuntimeError, OSError) as exc:
        log.warning("nats drain did not finish (%s); closing", type(exc).__name__)
    if not nc.is_closed:
        # The transport may already be gone; closing is best effort here.
        with contextlib.suppress(nats.errors.Error, RuntimeError, OSError):
            await nc.close()
