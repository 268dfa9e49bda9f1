"""Header names, deadlines and the timings header (`inferbus_common.protocol.headers`)."""

from __future__ import annotations

import time

from inferbus_common.protocol import headers


def test_header_names_are_distinct_and_valid() -> None:
    names = [v for k, v in vars(headers).items() if k.isupper() and isinstance(v, str)]
    assert len(names) == len(set(names))
    for name in names:
        # NATS headers follow HTTP field-name rules: visible ASCII, no ':' or spaces.
        assert name and all(33 <= ord(c) <= 126 and c != ":" for c in name), name


def test_deadlines_are_unix_ns() -> None:
    before = time.time_ns()
    deadline = headers.deadline_from_timeout(2.5)
    after = time.time_ns()
    assert before + 2_500_000_000 <= deadline <= after + 2_500_000_000
    assert 2.0 < headers.remaining_s(deadline) <= 2.5
    assert headers.remaining_s(headers.now_ns() - 1_000_000_000) < 0


def test_timings_round_trip() -> None:
    timings = {"queue": 0.412, "compute": 1.03}
    value = headers.format_timings(timings)
    assert value == "queue=0.412;compute=1.030"
    assert headers.parse_timings(value) == timings


def test_malformed_timings_parts_are_skipped() -> None:
    assert headers.parse_timings(None) == {}
    assert headers.parse_timings("") == {}
    assert headers.parse_timings("queue=abc;compute=2;junk") == {"compute": 2.0}
