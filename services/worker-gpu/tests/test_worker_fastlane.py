"""The worker's side of the fast lane: which messages it takes, as what."""

from __future__ import annotations

import numpy as np

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol.bundles import BundledRequest, encode_request_bundle
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import tensor_frame_parts
from inferbus_worker.fastlane import fast_batch


def _bundle(n: int) -> bytes:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    parts = tensor_frame_parts([tensor_from_numpy("input", x)])
    requests = [
        BundledRequest(Envelope(f"r{i}", "fraud", 123_000 + i, "", 0, ("out",), "tp"), 7 + i)
        for i in range(n)
    ]
    return encode_request_bundle("fraud", "3", "ib.reply.gw.b", requests, [parts] * n)


def test_a_bundle_of_one_is_a_micro_batch_of_one() -> None:
    batch = fast_batch(_bundle(1))
    assert batch is not None
    (entry,) = batch.entries
    assert (entry.request_id, entry.reply, entry.token) == ("r0", "ib.reply.gw.b", 7)
    assert (entry.deadline_ns, entry.rows, entry.outputs) == (123_000, 2, ("out",))
    assert entry.enqueued_ns > 0
    np.testing.assert_array_equal(
        batch.tensors[0].as_numpy(), np.arange(8, dtype=np.float32).reshape(2, 4)
    )


def test_anything_else_is_refused() -> None:
    assert fast_batch(_bundle(2)) is None  # the gateway sends lone requests only
    assert fast_batch(b"garbage") is None
