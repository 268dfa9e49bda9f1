"""Pulling from a JetStream durable consumer with public nats-py calls only.

A pull is JetStream's own protocol (NATS ADR-13), not a client feature: a
JSON request published to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>``
with a reply subject, answered by the messages themselves (their reply
subjects are the ``$JS.ACK...`` subjects `Msg.ack` uses) and, when the request
ends without filling its batch, a status message: ``404`` (nothing waiting,
for a no-wait pull), ``408`` (the request expired), ``409`` (the consumer was
deleted, its leader changed, or too many pulls wait). `PullConsumer` speaks
it over one ordinary subscription, so no private attribute of nats-py's
``PullSubscription`` is touched, and a no-wait pull never lingers on the
server the way ``fetch(n)`` does.
"""

from __future__ import annotations

import json

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

_STATUS = "Status"
_DESCRIPTION = "Description"
_GRACE_S = 0.5
"""Extra time a long poll waits for the server's own 408 before giving up on it."""


class ConsumerGone(Exception):
    """Nobody answers pulls for the consumer (it, or its stream, is gone), or the
    server ended the pull for a reason that needs the consumer looked at again."""


class PullConsumer:
    """Pull requests for one durable consumer, answered on one inbox subscription.

    Pulls run one at a time (the worker's pull loop is sequential). A message
    that arrives after its pull was given up is still a delivery: the next
    pull returns it (the subscription queues it).

    Args:
        nc: connected client.
        stream: stream name.
        consumer: durable consumer name.
        api_prefix: JetStream API prefix (``$JS.API``, or a domain's).
    """

    def __init__(self, nc: Client, stream: str, consumer: str, *, api_prefix: str = "$JS.API"):
        self._nc = nc
        self._subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._seq = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Subscribe to the inbox pulls are answered on."""
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", pending_msgs_limit=100_000)

    async def stop(self) -> None:
        """Unsubscribe (a pull still open on the server expires by itself)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def fetch(self, batch: int, expires_s: float, *, no_wait: bool = False) -> list[Msg]:
        """Up to `batch` messages.

        A long poll (``no_wait=False``) returns as soon as `batch` messages
        came, or when the server ends the request after `expires_s` with what
        came by then (possibly nothing). A no-wait pull returns what is
        waiting right now.

        Raises:
            ConsumerGone: the consumer or its stream is gone, or the server
                ended the pull with 409 (consumer deleted, leader changed, ...).
            nats.errors.Error: the connection failed.
        """
        assert self._sub is not None, "start() first"
        self._seq += 1
        reply = f"{self._inbox}.{self._seq}"
        out: list[Msg] = []
        request: dict[str, object] = {"batch": batch}
        if no_wait:
            request["no_wait"] = True
        else:
            request["expires"] = int(expires_s * 1e9)
        await self._nc.publish(self._subject, json.dumps(request).encode(), reply=reply)
        timeout = expires_s + _GRACE_S
        while len(out) < batch:
            try:
                msg = await self._sub.next_msg(timeout=timeout)
            except nats.errors.TimeoutError:
                break  # the server's end of the request never came: give up on it
            headers = msg.headers
            status = headers.get(_STATUS) if headers else None
            if not status:
                out.append(msg)
                continue
            if msg.subject != reply or status == "100":
                continue  # the end of an earlier pull, or a heartbeat
            if status in ("404", "408"):
                break
            description = headers.get(_DESCRIPTION, "") if headers else ""
            raise ConsumerGone(f"pull ended with {status} {description}".strip())
        return out
