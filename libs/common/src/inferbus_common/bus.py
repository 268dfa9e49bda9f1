"""Connecting to NATS and creating the JetStream objects the platform uses.

A connection may list several servers (a NATS cluster) and carries the replica
count of the streams and KV buckets created through it (`replicas_of`); see
docs/architecture.md ("Running on a NATS cluster").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import weakref
from collections.abc import Callable

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from inferbus_common import security
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

# Replica count of the JetStream objects each connection creates (see `connect`).
_replicas: weakref.WeakKeyDictionary[Client, int] = weakref.WeakKeyDictionary()
_error_hooks: weakref.WeakKeyDictionary[Client, list[Callable[[Exception], None]]] = (
    weakref.WeakKeyDictionary()
)


HEADER_ROOM = 4096
"""Bytes kept free under nats-server's ``max_payload`` for a message's headers."""


def body_limit(nc: Client) -> int:
    """The largest body a message on `nc` may carry beside its headers: the server's
    ``max_payload`` less `HEADER_ROOM`."""
    return nc.max_payload - HEADER_ROOM


def on_error(nc: Client, hook: Callable[[Exception], None]) -> None:
    """Call `hook` with every asynchronous error nats-server sends a connection made by
    `connect` (a permissions violation, for one: the server drops the message and says
    so only this way). Hooks run on the event loop and must not block."""
    _error_hooks.setdefault(nc, []).append(hook)


def is_publish_violation(exc: Exception, subject_prefix: str) -> bool:
    """Whether `exc` is nats-server's "Permissions Violation for Publish" on a subject
    that starts with `subject_prefix`."""
    text = str(exc)
    return "permissions violation for publish" in text.lower() and f'"{subject_prefix}' in text


def server_urls(url: str) -> list[str]:
    """The servers of a comma-separated URL list (``nats://a:4222,nats://b:4222``).

    Raises:
        ValueError: the list names no server.
    """
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}")
    return servers


def replicas_of(conn: Client | JetStreamContext) -> int:
    """Replicas for a stream or KV bucket created through this connection (1 by default)."""
    nc = conn._nc if isinstance(conn, JetStreamContext) else conn  # nats-py has no public handle
    return _replicas.get(nc, 1)


NO_STREAM_ERRORS: tuple[type[Exception], ...] = (
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
)
"""What a JetStream or KV call raises when its stream is gone (a NATS server that lost
its state): re-create it and try again."""


async def sync(nc: Client, timeout: int = 10) -> None:
    """Return once nats-server has processed every command `nc` sent before the call:
    the subscriptions just made take messages others publish from now on, and the
    messages just published have been routed.

    ``nc.flush()`` alone does not promise that. nats-py writes its PING straight to
    the socket, ahead of the SUB and PUB commands still waiting for its flusher
    task, and nats-server can answer PONG before it reads the commands behind the
    PING. A message another connection published right after such a flush could
    then find no subscriber and be lost (CI lost the first generative request
    through a fresh router this way; docs/architecture.md, "Reliability"). While
    the first round trip is under way the flusher writes what was queued, so the
    second PING goes behind those commands, and its PONG means the server has them.

    Raises:
        nats.errors.FlushTimeoutError: a PONG did not come within `timeout`.
        nats.errors.ConnectionClosedError: the connection is closed.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


async def leave(sub: Subscription) -> None:
    """Unsubscribe `sub` after taking in every message nats-server routed to it.

    For a queue group member leaving while others stay: what the server sent it
    before it saw the unsubscribe must still be served here, or it is lost (no
    other member gets it). nats-py's ``Subscription.drain`` sends UNSUB and
    waits for one PING's PONG, but its PING can overtake the UNSUB (see `sync`):
    the PONG then comes before the server has seen the UNSUB, drain forgets the
    subscription, and the messages routed to it in between arrive for an unknown
    subscription and are dropped (bench/findings.md, round 22: 4 of 600 calls to
    a gateway leaving the edge's group in CI). Here `sync` follows the UNSUB, so
    the server has it, and only then does drain wait for the messages already
    taken in and forget the subscription.

    Raises:
        nats.errors.Error: the connection is closed or a round trip timed out.
    """
    # nats-py has no public "UNSUB, but keep taking messages"; the test of this
    # function fails if these private names change.
    nc = sub._conn
    await nc._send_unsubscribe(sub._id)
    await sync(nc)
    await sub.drain()  # type: ignore[no-untyped-call]


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
    jetstream_replicas: int = 1,
) -> Client:
    """Connect to NATS with reconnects forever (a platform service never gives up).

    With several servers the client starts at a random one and, when its
    server goes away, reconnects to another; the subscriptions follow it.

    Args:
        url: server URL, or several separated by commas (the nodes of a
            cluster); ``tls://`` for TLS.
        name: connection name shown by the server.
        user, password: NATS user (its inbox prefix becomes ``_INBOX_<user>``,
            which the broker lets only that user read; see `security`).
        user_credentials: NKEY/JWT credentials file, instead of user and password.
        tls_ca_file: CA bundle for a ``tls://`` server.
        jetstream_replicas: replicas of the streams and KV buckets that
            `ensure_batch_stream`, `ensure_audit_stream` and
            `inferbus_common.catalog.ensure_kv` create through this connection
            (3 on a three-node cluster: each then survives the loss of a node).
    """
    servers = server_urls(url)

    nc: Client | None = None

    async def _disconnected() -> None:
        log.warning("nats disconnected", extra={"nats_url": url})

    async def _reconnected() -> None:
        server = nc.connected_url if nc is not None else None
        where = f"{server.hostname}:{server.port}" if server is not None else "?"
        log.info("nats reconnected to %s", where, extra={"nats_url": url})

    async def _error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)
        for hook in _error_hooks.get(nc, ()) if nc is not None else ():
            try:
                hook(exc)
            except Exception:  # a hook's failure must not stop the others
                log.exception("nats error hook failed")

    extra: dict[str, object] = {}
    if user:
        extra.update(user=user, password=password, inbox_prefix=security.inbox_prefix(user))
    if user_credentials:
        extra["user_credentials"] = user_credentials
    if tls_ca_file or any(s.startswith("tls://") for s in servers):
        extra["tls"] = ssl.create_default_context(cafile=tls_ca_file or None)

    nc = await nats.connect(
        servers,
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
    _replicas[nc] = jetstream_replicas
    return nc


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
    sets ``max_bytes`` and ``max_msgs_per_subject`` to its own settings, and
    raises its replicas to the connection's (`replicas_of`). Storage cannot
    change in place; a mismatch is logged with what to do.
    """
    replicas = replicas_of(js)
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
        num_replicas=replicas,
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
    # Replicas only ever go up here: fewer would be a choice for an operator.
    have_replicas = have.num_replicas or 1
    if (have.max_bytes, have.max_msgs_per_subject) != (
        max_bytes,
        max_msgs_per_subject,
    ) or have_replicas < replicas:
        have.max_bytes = max_bytes
        have.max_msgs_per_subject = max_msgs_per_subject
        have.num_replicas = max(have_replicas, replicas)
        await js.update_stream(have)
        log.info(
            "work-queue stream %s limits set to max_bytes=%d max_msgs_per_subject=%d replicas=%d",
            subjects.batch_stream,
            max_bytes,
            max_msgs_per_subject,
            have.num_replicas,
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
