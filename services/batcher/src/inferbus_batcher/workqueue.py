"""The batcher's side of the JetStream work queue: ensure the stream, store micro-batches.

Every failure to store comes back as `PublishFailed` carrying the status, the
message and the reason its requests are answered with; `docs/architecture.md`
("Work queue") describes the stream and its bounds.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from inferbus_batcher.settings import BatcherSettings
from inferbus_common.bus import NO_STREAM_ERRORS, ensure_batch_stream
from inferbus_common.errors import StatusCode
from inferbus_common.protocol import headers as h
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

# nats-server answers a store refused by stream limits (max bytes / msgs,
# discard-new) with this JetStream error code ("maximum ... exceeded").
_JS_STORE_FAILED = 10077


class PublishFailed(Exception):
    """A micro-batch could not be stored; carries the answer for its requests."""

    def __init__(self, code: StatusCode, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


class WorkQueue:
    """The ``IB_BATCHES`` stream as the batcher uses it.

    Args:
        js: the batcher's JetStream context.
        subjects: subject names of the deployment.
        settings: storage, bounds, publish timeout and attempts.
    """

    def __init__(self, js: JetStreamContext, subjects: Subjects, settings: BatcherSettings) -> None:
        self._js = js
        self._subjects = subjects
        self._settings = settings
        self._lock = asyncio.Lock()

    async def ensure(self) -> None:
        """Create the stream, or bring its bounds to the settings' values."""
        s = self._settings
        await ensure_batch_stream(
            self._js,
            self._subjects,
            storage=s.stream_storage,
            max_bytes=s.stream_max_bytes,
            max_msgs_per_subject=s.stream_max_msgs_per_subject,
            reconcile=True,
        )

    async def restore(self) -> bool:
        """Create the stream again after it vanished; True when it exists now.

        A memory-storage stream does not survive a nats-server restart (the
        key-value buckets, on file storage, do). Without this the batcher
        would refuse every micro-batch until it is restarted itself.
        One restore at a time; concurrent publishes wait for it.
        """
        async with self._lock:
            try:
                await self.ensure()
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                log.warning("work-queue stream could not be restored: %s", exc)
                return False
        log.info("work-queue stream %s restored", self._subjects.batch_stream)
        return True

    async def store(
        self, subject: str, model: str, version: str, payload: bytes, msg_id: str
    ) -> None:
        """Publish until acked; retries reuse `msg_id` (stored at most once).

        Raises:
            PublishFailed: not stored; the status and reason to answer with.
        """
        headers = {h.MODEL: model, h.VERSION: version, h.MSG_ID: msg_id}
        where = f"model '{model}' version '{version}'"
        s = self._settings
        for attempt in range(1, s.publish_attempts + 1):
            try:
                await self._js.publish(
                    subject, payload, timeout=s.publish_timeout_s, headers=dict(headers)
                )
                return
            except nats.errors.TimeoutError:
                if attempt == s.publish_attempts:
                    raise PublishFailed(
                        StatusCode.UNAVAILABLE,
                        f"work queue did not acknowledge the micro-batch for {where} "
                        f"after {attempt} attempts",
                        "work-queue-timeout",
                    ) from None
            except nats.js.errors.APIError as exc:
                if exc.err_code == _JS_STORE_FAILED or "exceeded" in (exc.description or ""):
                    raise PublishFailed(
                        StatusCode.RESOURCE_EXHAUSTED,
                        f"work queue is full, micro-batch for {where} refused: {exc.description}",
                        "work-queue-full",
                    ) from None
                raise PublishFailed(
                    StatusCode.UNAVAILABLE,
                    f"work queue refused the micro-batch for {where}: {exc.description}",
                    "work-queue-error",
                ) from None
            except NO_STREAM_ERRORS:
                if attempt < s.publish_attempts and await self.restore():
                    continue
                raise PublishFailed(
                    StatusCode.UNAVAILABLE,
                    f"no JetStream stream answers for {where}",
                    "work-queue-missing",
                ) from None
            except nats.errors.Error as exc:
                raise PublishFailed(
                    StatusCode.UNAVAILABLE,
                    f"could not publish the micro-batch for {where}: {type(exc).__name__}",
                    "bus-error",
                ) from None
