"""Triton-style version numbers: assignment, lookup, labels, bad version strings."""

from __future__ import annotations

import pytest

from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_common.versionnumbers import (
    check_version_text,
    downstream_version,
    find_by_number,
    integer_version,
    next_number,
    number_of,
    statistics_labels,
    triton_label,
)


def test_integer_versions_are_their_own_number_and_others_count_up() -> None:
    assert next_number("1.0.0", {}) == 1
    assert next_number("2.0.0", {"1.0.0": 1}) == 2
    assert next_number("3", {"1.0.0": 1}) == 3
    assert next_number("1.1.0", {"1.0.0": 1, "3": 3}) == 4
    # A record from before numbering counts as the integer it is, else as none.
    assert next_number("1.1.0", {"7": 0, "0.9.0": 0}) == 1
    # Its own earlier number does not count against a re-push.
    assert next_number("2", {"2": 2, "1.0.0": 1}) == 2
    with pytest.raises(FailedPrecondition, match=r"'1\.0\.0' already has it"):
        next_number("1", {"1.0.0": 1})
    # Numbers deleted versions had never come back for another version.
    assert next_number("2.0.0", {"1.0.0": 1}, floor=4) == 5
    assert next_number("3", {"1.0.0": 1}, floor=4) == 3


def test_numbers_name_versions_and_label_statistics() -> None:
    versions = [("1.0.0", 1), ("1.5.0", 2), ("7", 0)]
    assert find_by_number("2", versions) == "1.5.0"
    assert find_by_number("7", versions) == "7"
    assert find_by_number("3", versions) is None
    assert find_by_number("1.0.0", versions) is None
    assert find_by_number("0", versions) is None
    assert integer_version("12") == 12 and integer_version("1.0") is None
    assert number_of("4", 0) == 4 and number_of("1.0.0", 0) == 0
    assert triton_label("1.0.0", 1) == "1"
    assert triton_label("1.0.0", 0) == "1.0.0"


def test_statistics_are_labelled_as_perf_analyzer_looks_them_up() -> None:
    # A listing: each version under its number.
    assert statistics_labels("", "1.5.0", 2) == ["2"]
    assert statistics_labels("", "0.9.0", 0) == ["0.9.0"]
    # Named: under the name used and, for a non-integer, under stoll's integer too.
    assert statistics_labels("1.0.0", "1.0.0", 1) == ["1.0.0", "1"]
    assert statistics_labels("1.5.0", "1.5.0", 2) == ["1.5.0", "1"]
    assert statistics_labels("2", "1.5.0", 2) == ["2"]
    assert statistics_labels("3", "3", 3) == ["3"]
    assert statistics_labels("stable", "1.5.0", 2) == ["stable"]


def test_only_a_number_is_replaced_by_its_version_downstream() -> None:
    assert downstream_version("2", "1.5.0") == "1.5.0"
    assert downstream_version("1.5.0", "1.5.0") == "1.5.0"
    assert downstream_version("canary", "1.5.0") == "canary"
    assert downstream_version("", "1.5.0") == ""


@pytest.mark.parametrize("text", ["1.0.0", "3", "stable", "1.2.3-rc.1+b5"])
def test_well_formed_version_strings_pass(text: str) -> None:
    check_version_text(text)


@pytest.mark.parametrize("text", ["-1", "1 0", "../x", "a/b", "x" * 65, ".1"])
def test_bad_version_strings_get_tritons_wording(text: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_version_text(text)
    assert str(info.value).startswith(
        f"failed to get model version from specified version string '{text}'"
    )
