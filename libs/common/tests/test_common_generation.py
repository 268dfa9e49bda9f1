"""The generative request and chunk contract (`inferbus_common.generation`)."""

from __future__ import annotations

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_common.generation import GenerationChunk, GenerationRequest
from inferbus_common.subjects import Subjects


def test_request_round_trips_and_omits_defaults() -> None:
    req = GenerationRequest(
        kind="chat",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        ignore_eos=True,
    )
    body = req.encode()
    assert b"temperature" not in body  # defaults stay off the wire
    assert GenerationRequest.decode(body) == req


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"kind": "chat"}',
        b'{"kind": "chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
        b'{"kind": "completion", "prompt": "x", "temperature": 9}',
        b'{"kind": "completion", "prompt": "x", "unknown": 1}',
    ],
)
def test_bad_requests_are_invalid_argument(body: bytes) -> None:
    with pytest.raises(InvalidArgument):
        GenerationRequest.decode(body)


def test_chunk_round_trips_and_ignores_unknown_fields() -> None:
    chunk = GenerationChunk(
        text="he", tokens=2, finish_reason="length", prompt_tokens=5, completion_tokens=9
    )
    assert GenerationChunk.decode(chunk.encode()) == chunk
    assert GenerationChunk.decode(b'{"text": "x", "later": 1}').text == "x"
    with pytest.raises(ValueError):
        GenerationChunk.decode(b"[1, 2]")


def test_cancel_subject_never_collides_with_a_model_named_cancel() -> None:
    s = Subjects("ib")
    assert s.gen_cancel("req.1") == "ib.gencancel.req=2E1"
    assert s.gen_cancel_all == "ib.gencancel.*"
    assert not s.gen("cancel", "1").startswith("ib.gencancel")
