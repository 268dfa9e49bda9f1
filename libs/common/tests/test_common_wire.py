"""Tensor frames and micro-batches (`inferbus_common.protocol.tensors`, `.microbatch`)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from inferbus_common.codec import Tensor, serialize_bytes, tensor_from_numpy
from inferbus_common.errors import InvalidArgument, StatusCode
from inferbus_common.protocol.framing import FrameError
from inferbus_common.protocol.microbatch import (
    BatchEntry,
    MicroBatch,
    decode_batch,
    encode_joined_batch,
)
from inferbus_common.protocol.tensors import (
    batch_signature,
    decode_tensors,
    encode_tensors,
    join_tensors,
)


def _tensors() -> list[Tensor]:
    return [
        tensor_from_numpy("x", np.arange(12, dtype=np.float32).reshape(3, 4)),
        tensor_from_numpy("mask", np.array([[True], [False], [True]])),
        Tensor("text", "BYTES", (3,), serialize_bytes(["a", "", "ünï"])),
        tensor_from_numpy("scalar", np.array(7, dtype=np.int64)),
        tensor_from_numpy("名前", np.array([1.5, -2.0], dtype=np.float16)),
    ]


def _same(a: list[Tensor], b: list[Tensor]) -> None:
    assert [(t.name, t.datatype, t.shape, bytes(t.data)) for t in a] == [
        (t.name, t.datatype, t.shape, bytes(t.data)) for t in b
    ]


def test_tensor_frame_round_trip() -> None:
    tensors = _tensors()
    decoded = decode_tensors(encode_tensors(tensors))
    _same(decoded, tensors)
    assert decoded[0].as_numpy().tolist() == np.arange(12).reshape(3, 4).tolist()
    assert decoded[3].shape == ()
    assert decoded[3].as_numpy() == 7


def test_empty_frame_and_empty_tensor() -> None:
    assert decode_tensors(encode_tensors([])) == []
    empty = Tensor("e", "FP32", (0, 4), b"")
    _same(decode_tensors(encode_tensors([empty])), [empty])


def test_tensor_data_are_zero_copy_slices() -> None:
    frame = bytearray(encode_tensors(_tensors()))
    decoded = decode_tensors(frame)
    data = decoded[0].data
    assert isinstance(data, memoryview)
    assert data.obj is frame
    array = decoded[0].as_numpy()
    assert np.shares_memory(array, np.frombuffer(frame, dtype=np.uint8))
    # Writing the frame is visible through the tensor: nothing was copied.
    offset = bytes(frame).index(np.arange(12, dtype=np.float32).tobytes())
    frame[offset : offset + 4] = np.float32(42).tobytes()
    assert decoded[0].as_numpy()[0, 0] == 42


def test_every_truncation_of_a_tensor_frame_is_a_frame_error() -> None:
    frame = encode_tensors(_tensors())
    for cut in range(len(frame)):
        with pytest.raises(FrameError):
            decode_tensors(frame[:cut])


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"", "bad magic"),
        (b"IBB1\x00\x00", "bad magic"),
        (b"NOPE" + b"\x00" * 20, "bad magic"),
        (b"IBT1\x01", "truncated tensor frame"),
        (b"IBT1\x01\x00\x01\x00x\x63\x00" + struct.pack("<Q", 0), "unknown datatype code 99"),
        (b"IBT1\x01\x00\x01\x00x\x0a\x21", "has 33 dimensions"),
        (
            b"IBT1\x01\x00\x01\x00x\x0a\x01" + struct.pack("<qQ", 1, 4) + b"\x00\x00",
            "tensor 'x' data is truncated",
        ),
        (b"IBT1\x01\x00\x02\x00\xff\xfe\x0a\x00" + struct.pack("<Q", 0), "not valid UTF-8"),
        (encode_tensors([Tensor("x", "FP32", (1,), b"\x00" * 4)]) + b"zz", "2 trailing bytes"),
    ],
)
def test_malformed_tensor_frames_say_what_is_wrong(frame: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        decode_tensors(frame)


def test_frame_error_is_an_invalid_argument() -> None:
    assert issubclass(FrameError, InvalidArgument)
    assert FrameError("x").code is StatusCode.INVALID_ARGUMENT


def test_garbage_after_the_magic_never_raises_anything_else() -> None:
    rng = np.random.default_rng(1234)
    for _ in range(300):
        garbage = b"IBT1" + rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        try:
            decode_tensors(garbage)
        except FrameError:
            pass


def _entries() -> list[BatchEntry]:
    return [
        BatchEntry("r1", "ib.reply.gw1.b", 1_700_000_000_000_000_000, 1_699_999_999_000_000_000, 2,
                   ("y", "z"), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", token=1),
        BatchEntry("r2-ü", "ib.reply.gw2.b", 0, 5, 1, token=9),
    ]  # fmt: skip


def test_micro_batch_round_trip() -> None:
    x = tensor_from_numpy("x", np.arange(6, dtype=np.int32).reshape(3, 2))
    batch = decode_batch(encode_joined_batch(_entries(), [[x]]))
    assert isinstance(batch, MicroBatch)
    assert batch.entries == _entries()
    assert batch.entries[1].outputs == ()
    assert batch.rows == 3
    _same(batch.tensors, [x])


def test_micro_batch_tensors_are_zero_copy() -> None:
    x = tensor_from_numpy("x", np.arange(6, dtype=np.int32).reshape(3, 2))
    message = encode_joined_batch(_entries(), [[x]])
    batch = decode_batch(message)
    assert isinstance(batch.tensors[0].data, memoryview)
    assert batch.tensors[0].data.obj is message


def test_every_truncation_of_a_micro_batch_is_a_frame_error() -> None:
    x = tensor_from_numpy("x", np.arange(6, dtype=np.int32).reshape(3, 2))
    message = encode_joined_batch(_entries(), [[x]])
    for cut in range(len(message)):
        with pytest.raises(FrameError):
            decode_batch(message[:cut])


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (b"IBT1\x00\x00", "not an inferbus micro-batch"),
        (b"IBB1\x01\x00\x00\x00", "not an inferbus micro-batch"),
        (b"IBB3\x01\x00\x05\x00ab", "a string is cut off"),
        (b"IBB3\x01\x00\x02\x00\xff\xfe", "not valid UTF-8"),
        (b"IBB3\x00\x00\x01\x00\x00", "truncated micro-batch header"),
        (encode_joined_batch([], [[]]) + b"!", "1 trailing bytes after micro-batch"),
    ],
)
def test_malformed_micro_batches(message: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_batch(message)


def test_overlong_header_string_is_rejected() -> None:
    entry = BatchEntry("r" * 70_000, "s", 0, 0, 1)
    with pytest.raises(FrameError, match="more than 65535"):
        encode_joined_batch([entry], [[]])


def test_join_tensors_concatenates_rows_in_order() -> None:
    a = [
        tensor_from_numpy("x", np.arange(4, dtype=np.float32).reshape(2, 2)),
        Tensor("s", "BYTES", (2,), serialize_bytes([b"p", b"q"])),
    ]
    b = [
        tensor_from_numpy("x", np.arange(4, 6, dtype=np.float32).reshape(1, 2)),
        Tensor("s", "BYTES", (1,), serialize_bytes([b"r"])),
    ]
    joined = join_tensors([a, b])
    assert [t.shape for t in joined] == [(3, 2), (3,)]
    assert joined[0].as_numpy().tolist() == np.arange(6, dtype=np.float32).reshape(3, 2).tolist()
    assert joined[1].as_numpy().tolist() == [b"p", b"q", b"r"]


def test_batch_signature_groups_compatible_requests() -> None:
    def req(rows: int, cols: int = 4, dtype: type = np.float32, name: str = "x") -> list[Tensor]:
        return [tensor_from_numpy(name, np.zeros((rows, cols), dtype=dtype))]

    assert batch_signature(req(1)) == batch_signature(req(7))
    assert batch_signature(req(1)) != batch_signature(req(1, cols=5))
    assert batch_signature(req(1)) != batch_signature(req(1, dtype=np.float64))
    assert batch_signature(req(1)) != batch_signature(req(1, name="y"))
    hash(batch_signature(req(1)))  # usable as a dict key
