"""The protocol package's shared rules: one sanitiser, one envelope, one batch rule."""

from __future__ import annotations

import pytest

from inferbus_common.batchrule import BatchRule
from inferbus_common.errors import ResourceExhausted
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol import Envelope, one_line
from inferbus_common.protocol import headers as h
from inferbus_common.protocol.bundles import BundledReply, decode_reply_bundle, encode_reply_bundle
from inferbus_common.protocol.replies import error_headers


def test_one_line_flattens_and_caps_text() -> None:
    assert one_line("bad\n index:\t1\r\n") == "bad index: 1"
    assert one_line("") == ""
    assert len(one_line("x " * 5000)) == 1024


def test_streamed_error_headers_are_one_line() -> None:
    """`error_headers` (router, LLM worker) applies the same rule as reply bundles."""
    exc = ResourceExhausted("queue\nfull\n" + "y" * 3000, reason="queue-full")
    headers = error_headers(exc, "r1")
    assert "\n" not in headers[h.ERROR] and len(headers[h.ERROR]) == 1024
    assert headers[h.REASON] == "queue-full"
    bundle = encode_reply_bundle("1", "", "", 0, [BundledReply(1, "INTERNAL", exc.message)], [()])
    assert decode_reply_bundle(bundle).replies[0].error == headers[h.ERROR]


def test_an_envelope_is_frozen() -> None:
    env = Envelope("r1", "m", 5, outputs=("y",))
    with pytest.raises(AttributeError):
        env.traceparent = "x"  # type: ignore[misc]  # the point of the test
    changed = env._replace(traceparent="tp")
    assert (changed.outputs, changed.traceparent, env.traceparent) == (("y",), "tp", "")


def _rule(max_batch_size: int, preferred: list[int]) -> BatchRule:
    return BatchRule.of(
        ModelConfig(
            name="m",
            max_batch_size=max_batch_size,
            inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 1]}],
            outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
            batching={"preferred_batch_sizes": preferred},
        )
    )


def test_the_batch_rule_takes_the_largest_preferred_prefix() -> None:
    rule = _rule(16, [4, 8, 32])  # 32 is above the maximum: dropped
    assert rule.preferred == frozenset({4, 8})
    assert rule.cut([2, 2, 4, 3], waited=False) == 3  # 2+2+4 = 8
    assert rule.cut([2, 1], waited=False) == 0  # nothing preferred yet: wait
    assert rule.cut([2, 1], waited=True) == 2  # the delay passed: what there is
    assert rule.cut([5, 5, 5, 5], waited=True) == 3  # 20 rows do not fit in 16


def test_the_worker_merge_uses_the_same_rule() -> None:
    rule = _rule(16, [4, 8])
    assert rule.merge([4, 4, 4]) == 2  # 8 is preferred, 12 is not
    assert rule.merge([3, 3]) == 2  # no preferred size forms: all that fit
    assert rule.merge([16, 1]) == 1
    assert _rule(16, []).merge([4, 4, 4, 4, 4]) == 4  # no preferences: fill to 16
    assert BatchRule(0).merge([1, 1]) == 1  # no batch axis: one at a time
