"""Sequence ids on the bus and the placement of new sequences on workers."""

from __future__ import annotations

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_common.sequences import (
    SequenceFlags,
    check_sequence_id,
    decode_sequence_id,
    describe,
    encode_sequence_id,
    place,
)


@pytest.mark.parametrize("value", [0, ""])
def test_zero_and_empty_mean_no_sequence(value: object) -> None:
    assert check_sequence_id(value) is None


@pytest.mark.parametrize("value", [1, 2**64 - 1, "abc", "1000"])
def test_valid_ids_are_kept_as_they_are(value: object) -> None:
    assert check_sequence_id(value) == value


@pytest.mark.parametrize("value", [-1, 2**64, True, 1.5, None, ["a"], "x" * 257])
def test_invalid_ids_are_refused(value: object) -> None:
    with pytest.raises(InvalidArgument, match="sequence_id"):
        check_sequence_id(value)


def test_integer_and_string_ids_stay_apart_on_the_bus() -> None:
    assert encode_sequence_id(1000) != encode_sequence_id("1000")
    for sid in (1000, "1000", "a:b", "ü"):
        assert decode_sequence_id(encode_sequence_id(sid)) == sid
    assert describe(1000) == "1000"
    assert describe("1000") == "'1000'"


@pytest.mark.parametrize("text", ["", "i:", "i:x", "i:0", "s:", "x:1", "1000"])
def test_malformed_bus_ids_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgument):
        decode_sequence_id(text)


def test_flags_round_trip() -> None:
    for start in (False, True):
        for end in (False, True):
            flags = SequenceFlags(7, start, end)
            assert SequenceFlags.from_flags(7, flags.flags) == flags
    assert SequenceFlags(7).flags == ""
    assert SequenceFlags(7, True, True).flags == "start,end"


def test_placement_is_the_same_for_every_caller_and_order() -> None:
    workers = [f"w{i}" for i in range(5)]
    chosen = {sid: place(workers, "m", "1", sid) for sid in range(200)}
    assert chosen == {sid: place(list(reversed(workers)), "m", "1", sid) for sid in range(200)}
    # Spread over the workers (each gets a share of 200 sequences).
    assert all(list(chosen.values()).count(w) > 15 for w in workers)
    assert place([], "m", "1", 1) is None


def test_a_joining_or_leaving_worker_moves_only_its_own_sequences() -> None:
    workers = ["a", "b", "c", "d"]
    before = {sid: place(workers, "m", "1", sid) for sid in range(400)}
    joined = {sid: place([*workers, "e"], "m", "1", sid) for sid in range(400)}
    moved = [sid for sid in before if before[sid] != joined[sid]]
    assert moved and all(joined[sid] == "e" for sid in moved)
    left = {sid: place(["a", "b", "c"], "m", "1", sid) for sid in range(400)}
    assert all(left[sid] == before[sid] for sid in before if before[sid] != "d")
