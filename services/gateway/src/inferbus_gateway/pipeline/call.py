"""One ModelInfer on its way through the gateway, and how steps compose around it.

A step is an object with one job (admit, replay, fall back, audit ...) called
as ``await step(call, next_step)``: it may act before, call ``next_step(call)``
once, act on the answer or the error, and return the answer. `compose` nests
steps around the handler that answers (`InferHandler`), outermost first, so
the order of a list of steps is the order a request meets them.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from inferbus_gateway.canonical import InferRequest, InferResponse

_ID_PREFIX = secrets.token_hex(8)
_id_counter = itertools.count(1)


def new_request_id() -> str:
    """An id for a request that brings none: 32 hex digits like ``uuid4().hex``, a
    random prefix per process and a counter (no system call per id)."""
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


@dataclass(slots=True)
class InferCall:
    """A request, where it came from, and what the gateway learned while answering it.

    The learned fields are kept for the audit record even when the request fails.

    Attributes:
        request: the canonical request (steps may fill `tenant`, shared-memory inputs).
        protocol: ``grpc`` or ``http`` (metric and audit label).
        headers: HTTP headers or gRPC metadata, lower-case names.
        t0: `time.perf_counter` when the gateway took the request.
        request_id: the client's id, or one made for it.
        version: the version that answered, once known (the pinned one before).
        digest: the artifact digest of that version, once known.
        timings_ms: the answer's stage timings, once answered.
    """

    request: InferRequest
    protocol: str
    headers: Mapping[str, str]
    t0: float
    request_id: str
    version: str = ""
    digest: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(
        cls, request: InferRequest, protocol: str, headers: Mapping[str, str] | None = None
    ) -> InferCall:
        """A call for a request taken now."""
        return cls(
            request,
            protocol,
            headers or {},
            time.perf_counter(),
            request.id or new_request_id(),
            request.version,
        )


Handler = Callable[[InferCall], Awaitable[InferResponse]]
"""Answers a call (the `InferHandler`, or it wrapped in steps)."""


class Step(Protocol):
    """One cross-cutting job around answering a request.

    A step with nothing to do for a call may return ``next_step(call)``
    itself instead of awaiting it in a coroutine of its own: one frame less
    on every such request (`SharedMemory`, `Idempotency`).
    """

    def __call__(self, call: InferCall, next_step: Handler) -> Awaitable[InferResponse]:
        """Answer `call`, normally by awaiting ``next_step(call)`` once."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A step that holds work to finish at shutdown (audit records not yet published)."""

    async def close(self) -> None:
        """Finish what the step still holds."""
        ...


def compose(steps: Sequence[Step], handler: Handler) -> Handler:
    """`handler` wrapped in `steps`, the first step outermost.

    Each layer is a `functools.partial` of its step, so a request costs one
    coroutine per step and no extra wrapper frames.
    """
    for step in reversed(steps):
        handler = functools.partial(step, next_step=handler)
    return handler
