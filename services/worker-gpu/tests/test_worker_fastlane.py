"""The worker's side of the fast lane: which messages it takes, as what."""

from __future__ import annotations

import numpy as np

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.protocol.bundles import BundledRequest, encode_request_bundle
from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.tensors import tensor_frame_parts
from inferbus_worker.fastlane import fast_batch


def _bundle(n: int, widths: tuple[int, ...] = ()) -> bytes:
    requests, parts = [], []
    for i in range(n):
        width = widths[i] if widths else 4
        x = np.arange(2 * width, dtype=np.float32).reshape(2, width) + 100 * i
        parts.append(tensor_frame_parts([tensor_from_numpy("input", x)]))
        env = Envelope(f"r{i}", "fraud", 123_000 + i, "", 0, ("out",), "tp")
        requests.append(BundledRequest(env, 7 + i))
    return encode_request_bundle("fraud", "3", "ib.reply.gw.b", requests, parts)


def test_a_bundle_of_one_is_a_micro_batch_of_one() -> None:
    batch = fast_batch(_bundle(1), 32)
    assert batch is not None
    (entry,) = batch.entries
    assert (entry.request_id, entry.reply, entry.token) == ("r0", "ib.reply.gw.b", 7)
    assert (entry.deadline_ns, entry.rows, entry.outputs) == (123_000, 2, ("out",))
    assert entry.enqueued_ns > 0
    np.testing.assert_array_equal(
        batch.tensors[0].as_numpy(), np.arange(8, dtype=np.float32).reshape(2, 4)
    )


def test_a_released_bundle_of_several_is_one_micro_batch_in_row_order() -> None:
    batch = fast_batch(_bundle(3), 32)
    assert batch is not None
    assert [(e.request_id, e.token, e.rows) for e in batch.entries] == [
        ("r0", 7, 2),
        ("r1", 8, 2),
        ("r2", 9, 2),
    ]
    want = np.concatenate(
        [np.arange(8, dtype=np.float32).reshape(2, 4) + 100 * i for i in range(3)]
    )
    np.testing.assert_array_equal(batch.tensors[0].as_numpy(), want)


def test_anything_else_is_refused() -> None:
    assert fast_batch(_bundle(3), 5) is None  # 6 rows: more than the model's batch
    assert fast_batch(_bundle(2), 0) is None  # a model that does not batch
    assert fast_batch(_bundle(2, (4, 5)), 32) is None  # shapes that cannot join
    assert fast_batch(_bundle(1), 0) is not None  # alone it runs as it is
    assert fast_batch(b"garbage", 32) is None
