"""gzip/deflate request and response bodies of the REST infer endpoint."""

from __future__ import annotations

import gzip
import zlib

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_gateway.rest.compression import (
    BodyTooLarge,
    compress,
    decompress,
    response_encoding,
)

BODY = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.5]}]}' * 10


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("GZIP", gzip.compress),
        ("deflate", zlib.compress),  # what tritonclient sends for deflate
        ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients do
        ("", lambda b: b),
        ("identity", lambda b: b),
    ],
)
def test_bodies_decompress(encoding: str, encode) -> None:
    assert decompress(encode(BODY), encoding, 1 << 20) == BODY


def test_decompressed_size_is_limited_while_decompressing() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))  # 8 MiB of zeros in ~8 KiB
    assert len(bomb) < 64 << 10
    with pytest.raises(BodyTooLarge, match="more than the limit of 1048576"):
        decompress(bomb, "gzip", 1 << 20)


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (b"not gzip at all", "gzip", "not valid gzip"),
        (gzip.compress(BODY)[:-12], "gzip", "truncated gzip"),
        (BODY, "br", "unsupported Content-Encoding 'br'"),
    ],
)
def test_bad_encodings_are_client_errors(body: bytes, encoding: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as err:
        decompress(body, encoding, 1 << 20)
    assert not isinstance(err.value, BodyTooLarge)


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("deflate, gzip", "gzip"),
        ("gzip;q=0, deflate", "deflate"),
        ("br", None),
        ("", None),
        ("*", "gzip"),
        ("identity", None),
    ],
)
def test_response_encoding_follows_accept_encoding(accept: str, chosen: str | None) -> None:
    assert response_encoding(accept) == chosen


def test_responses_compress_for_the_client() -> None:
    assert gzip.decompress(compress(BODY, "gzip")) == BODY
    assert zlib.decompress(compress(BODY, "deflate")) == BODY
