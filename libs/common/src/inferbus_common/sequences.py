"""Sequence ids of stateful models and the placement of a sequence on a worker.

A request of a sequence model carries Triton's ``sequence_id`` (an unsigned
integer or a string; 0 and "" mean none), ``sequence_start`` and
``sequence_end``. On the bus the id travels as ``i:<integer>`` or
``s:<text>`` (`headers.SEQUENCE_ID`), so ``1000`` and ``"1000"`` stay two
sequences, as in Triton. A new sequence is placed by rendezvous hashing
(highest BLAKE2b score of worker and sequence) over the workers that serve
the version: every gateway computes the same worker, and a worker joining
or leaving moves only the sequences it gains or held. See
docs/architecture.md ("Sequences").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from inferbus_common.errors import InvalidArgument

SequenceId = int | str
"""Triton's correlation id: an unsigned 64-bit integer or a string."""

_MAX_ID = (1 << 64) - 1
MAX_STRING_ID = 256
"""Longest string sequence id accepted (bytes of UTF-8)."""


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    """A request's place in its sequence.

    Attributes:
        id: the sequence id (never 0 or "").
        start: the first request (state starts from zero).
        end: the last request (state is freed after it).
    """

    id: SequenceId
    start: bool = False
    end: bool = False

    @property
    def flags(self) -> str:
        """The `headers.SEQUENCE_FLAGS` value ('' for a middle request)."""
        return ",".join(f for f, on in (("start", self.start), ("end", self.end)) if on)

    @classmethod
    def from_flags(cls, sid: SequenceId, flags: str) -> SequenceFlags:
        """Rebuild from a sequence id and a `headers.SEQUENCE_FLAGS` value."""
        parts = set(flags.split(",")) if flags else set()
        return cls(sid, "start" in parts, "end" in parts)


def check_sequence_id(value: object) -> SequenceId | None:
    """A client's ``sequence_id`` parameter as a sequence id; None for 0 / "" (no sequence).

    Raises:
        InvalidArgument: a negative or too large integer, a too long string,
            or another type.
    """
    if isinstance(value, bool):
        raise InvalidArgument("parameter 'sequence_id' must be an integer or a string, not bool")
    if isinstance(value, int):
        if value == 0:
            return None
        if not 0 < value <= _MAX_ID:
            raise InvalidArgument(
                f"parameter 'sequence_id' {value} is out of range (1 .. 2^64-1 for an integer id)"
            )
        return value
    if isinstance(value, str):
        if not value:
            return None
        if len(value.encode("utf-8")) > MAX_STRING_ID:
            raise InvalidArgument(f"parameter 'sequence_id' is longer than {MAX_STRING_ID} bytes")
        return value
    raise InvalidArgument(
        f"parameter 'sequence_id' must be an integer or a string, not {type(value).__name__}"
    )


def encode_sequence_id(sid: SequenceId) -> str:
    """The `headers.SEQUENCE_ID` value of a sequence id."""
    return f"i:{sid}" if isinstance(sid, int) else f"s:{sid}"


def decode_sequence_id(text: str) -> SequenceId:
    """Inverse of `encode_sequence_id`.

    Raises:
        InvalidArgument: not an encoded sequence id.
    """
    kind, sep, value = text.partition(":")
    if sep and kind == "i" and value.isdigit():
        sid = int(value)
        if 0 < sid <= _MAX_ID:
            return sid
    if sep and kind == "s" and value:
        return value
    raise InvalidArgument(f"malformed sequence id {text!r}")


def describe(sid: SequenceId) -> str:
    """How a sequence id is named in messages: ``1000`` or ``'abc'``."""
    return str(sid) if isinstance(sid, int) else repr(sid)


def place(workers: Iterable[str], model: str, version: str, sid: SequenceId) -> str | None:
    """The worker a new sequence goes to: rendezvous hashing over `workers`.

    Returns None when there is no worker.
    """
    key = f"\x00{model}\x00{version}\x00{encode_sequence_id(sid)}".encode()
    best: tuple[bytes, str] | None = None
    for worker in workers:
        score = hashlib.blake2b(worker.encode() + key, digest_size=8).digest()
        if best is None or (score, worker) > best:
            best = (score, worker)
    return best[1] if best is not None else None
