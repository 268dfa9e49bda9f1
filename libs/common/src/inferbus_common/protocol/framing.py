"""The byte helpers every inferbus message format shares, its one error type,
and the one sanitiser for text that goes into a reply.

Little-endian, length-prefixed strings (u16 length, UTF-8 bytes); decoders
read from a `memoryview` and raise `FrameError` for anything truncated or
malformed, never `struct.error`, `IndexError` or `UnicodeDecodeError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from inferbus_common.codec import Buffer
from inferbus_common.errors import InvalidArgument

U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
MAX_STR = 0xFFFF
"""Longest string (in UTF-8 bytes) a length-prefixed field holds."""
MAX_TEXT = 1024
"""Error text and header values are cut to this many characters."""


class FrameError(InvalidArgument):
    """A bus message is not in the expected binary format (bad magic, truncated,
    trailing bytes, an index outside its table, invalid UTF-8)."""


def one_line(text: str) -> str:
    """`text` as one line of at most `MAX_TEXT` characters.

    The one rule for every error message and header value a service sends:
    NATS header values cannot hold line breaks, engine and library messages
    often do, and a client should not receive a page of traceback.
    """
    return " ".join(text.split())[:MAX_TEXT] if text else ""


def put_str(parts: list[Buffer], value: str) -> None:
    """Append `value` as a length-prefixed UTF-8 string.

    Raises:
        FrameError: longer than 65,535 bytes.
    """
    raw = value.encode("utf-8")
    if len(raw) > MAX_STR:
        raise FrameError(f"a string field is {len(raw)} bytes, more than {MAX_STR}")
    parts.append(U16.pack(len(raw)))
    parts.append(raw)


def get_str(view: memoryview, offset: int) -> tuple[str, int]:
    """The length-prefixed string at `offset`, and the offset after it.

    Raises:
        FrameError: truncated or not UTF-8.
    """
    try:
        (n,) = U16.unpack_from(view, offset)
    except struct.error:
        raise FrameError("truncated message: a string's length is cut off") from None
    offset += 2
    end = offset + n
    if end > view.nbytes:
        raise FrameError("truncated message: a string is cut off")
    try:
        return bytes(view[offset:end]).decode("utf-8"), end
    except UnicodeDecodeError as exc:
        raise FrameError(f"a string field is not valid UTF-8: {exc}") from None


def parts_size(parts: Sequence[Buffer]) -> int:
    """Total bytes of the pieces of a message (before their one join)."""
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


def split_outputs(outs: str) -> tuple[str, ...]:
    """Requested output names from their comma-joined form ('' = all)."""
    return tuple(o for o in outs.split(",") if o) if outs else ()
