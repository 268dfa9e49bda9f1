"""HTTP request and response compression of the V2 REST infer endpoint (gzip, deflate).

As Triton's HTTP endpoint and `tritonclient.http`: a request body with
``Content-Encoding: gzip`` or ``deflate`` (zlib format) is decompressed
before parsing, and ``Inference-Header-Content-Length`` counts the
decompressed bytes; a response is compressed when ``Accept-Encoding`` names
one of them. Decompression stops as soon as the output passes the body
limit (a small "zip bomb" cannot make the gateway hold more than the limit).
"""

from __future__ import annotations

import zlib

from inferbus_common.errors import InvalidArgument

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""Content-Encoding → zlib window bits (gzip header, zlib header)."""

RESPONSE_LEVEL = 1
"""zlib level of compressed responses: tensors compress little, speed matters more."""


class BodyTooLarge(InvalidArgument):
    """A request body (or what it decompresses to) is over the limit: HTTP 413."""


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body decoded from `encoding` (``Content-Encoding``; identity when empty).

    Raises:
        InvalidArgument: an encoding other than gzip/deflate, or data that is
            not in it (corrupt or truncated).
        BodyTooLarge: it decompresses to more than `limit` bytes.
    """
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise InvalidArgument(
            f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none"
        )
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        if encoding == "deflate":
            # Some clients send raw deflate (no zlib header) for "deflate".
            try:
                d = zlib.decompressobj(-zlib.MAX_WBITS)
                out = d.decompress(body, limit + 1)
            except zlib.error:
                raise InvalidArgument(f"request body is not valid {encoding} data: {exc}") from None
        else:
            raise InvalidArgument(f"request body is not valid {encoding} data: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise BodyTooLarge(f"request body decompresses to more than the limit of {limit} bytes")
    if not d.eof:
        raise InvalidArgument(f"request body is truncated {encoding} data")
    return out


def response_encoding(accept_encoding: str) -> str | None:
    """The encoding to answer with for an ``Accept-Encoding`` header (None: identity).

    gzip is preferred over deflate; a coding with ``q=0`` is refused.
    """
    offered: dict[str, float] = {}
    for part in accept_encoding.lower().split(","):
        name, _, params = part.strip().partition(";")
        q = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                q = float(params[2:])
            except ValueError:
                q = 0.0
        offered[name.strip()] = q
    for name in ("gzip", "deflate"):
        if offered.get(name, offered.get("*", 0.0)) > 0:
            return name
    return None


def compress(payload: bytes, encoding: str) -> bytes:
    """`payload` compressed as `encoding` (``gzip`` or ``deflate``)."""
    c = zlib.compressobj(RESPONSE_LEVEL, zlib.DEFLATED, _WBITS[encoding])
    return c.compress(payload) + c.flush()
