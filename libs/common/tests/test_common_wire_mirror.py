"""Micro-batches that carry a mirror subject (shadow compare): IBB2."""

from __future__ import annotations

import numpy as np

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol.microbatch import BatchEntry, decode_batch, encode_batch


def test_mirror_subjects_round_trip_and_plain_batches_stay_ibb1() -> None:
    tensors = [tensor_from_numpy("x", np.arange(6, dtype=np.float32).reshape(3, 2))]
    plain = [BatchEntry("a", "r.1", 0, 1, 1), BatchEntry("b", "r.2", 5, 1, 2, ("y",), "tp")]
    data = encode_batch(plain, tensors)
    assert data[:4] == b"IBB1"
    assert decode_batch(data).entries == plain

    mirrored = [plain[0], BatchEntry("b", "r.2", 5, 1, 2, ("y",), "tp", "ib.reply.r1.shadow.p.7")]
    data = encode_batch(mirrored, tensors)
    assert data[:4] == b"IBB2"
    batch = decode_batch(data)
    assert batch.entries == mirrored
    assert [e.mirror for e in batch.entries] == ["", "ib.reply.r1.shadow.p.7"]
    assert batch.tensors[0].as_numpy().tolist() == [[0, 1], [2, 3], [4, 5]]
