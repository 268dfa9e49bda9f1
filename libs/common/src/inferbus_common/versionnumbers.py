"""Triton-style integer numbers for inferbus's semantic versions.

Triton names a model's versions by integers, and its tools depend on it:
perf_analyzer parses the version it is given (``-x 1.0.0``) with ``stoll``
(giving 1) and looks the server's statistics up under ``"1"``; without
``-x`` it takes the highest ``stoll`` of the versions the statistics list.
inferbus versions are semantic (``1.0.0``), so every version also gets a
**number**, assigned by the registry when the version is pushed, written in
its ``manifest.json`` and carried in its catalog record
(`inferbus_common.catalogrecords.DeployedVersion.number`):

- a version that is a plain integer (``3``) has that integer as its number,
  so Triton-style repositories keep their numbering;
- any other version gets one more than the highest number the model has
  given (deleted versions included), so numbers grow with every push.

Numbers are unique within a model, so the decimal form of a number names
exactly one version: wherever a version is accepted, its number is too
(`find_by_number`). Statistics label every version with its number, or
with what perf_analyzer will look for when it was named
(`statistics_labels`). The registry refuses an integer version whose
integer is already another version's number. See docs/architecture.md
("Version numbers for Triton's tools").

Pure functions over plain values, so that the gateway's catalog, the
registry and the version resolver can all call them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from inferbus_common.errors import FailedPrecondition, InvalidArgument

_INTEGER_RE = re.compile(r"^[0-9]{1,18}$")
"""A plain integer (at most 18 digits: always fits Triton's int64)."""

_VERSION_TEXT_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_.+-]{0,63}$")
"""What a version, an alias or a number may look like at all (registry naming)."""


def integer_version(text: str) -> int | None:
    """The integer `text` is when it is a plain integer (``"3"``), else None."""
    return int(text) if _INTEGER_RE.match(text) else None


def number_of(version: str, number: int) -> int:
    """A version's number: the recorded `number`, else (a record written before
    versions were numbered) the integer the version is, else 0 (none)."""
    if number > 0:
        return number
    return integer_version(version) or 0


def next_number(version: str, taken: Mapping[str, int], floor: int = 0) -> int:
    """The number the registry gives a new `version` of a model.

    Args:
        version: the version being pushed.
        taken: the numbers of the model's other versions (version → number;
            0 for none).
        floor: the highest number the model ever gave (deleted versions
            included); a non-integer version gets a number above it, so a
            number never comes back for another version.

    Raises:
        FailedPrecondition: `version` is an integer that another version
            already has as its number.
    """
    used = {n: v for v, n in taken.items() if n > 0 and v != version}
    own = integer_version(version)
    if own is not None:
        if own in used:
            raise FailedPrecondition(
                f"version {version!r} would have number {own} for Triton's tools, but version "
                f"{used[own]!r} already has it; push it under another version"
            )
        return own
    return max(max(used, default=0), floor) + 1


def find_by_number(text: str, numbered: Iterable[tuple[str, int]]) -> str | None:
    """The version whose number `text` (a decimal integer) is, else None.

    Args:
        text: what the client sent as the version.
        numbered: (version, number) of each of the model's versions.
    """
    wanted = integer_version(text)
    if wanted is None or wanted == 0:
        return None
    for version, number in numbered:
        if number_of(version, number) == wanted:
            return version
    return None


def triton_label(version: str, number: int) -> str:
    """The version as Triton's clients see it in statistics: the number in
    decimal, or the version itself when it has none."""
    n = number_of(version, number)
    return str(n) if n > 0 else version


_LEADING_DIGITS_RE = re.compile(r"^[0-9]{1,18}")


def statistics_labels(asked: str, version: str, number: int) -> list[str]:
    """The ``version`` labels of a version's statistics entries.

    Asked for no version in particular (a listing), each version is labelled
    with its number (`triton_label`). Asked for one by name, its entry is
    labelled with the name the client used and, when that name is not a plain
    integer, repeated under the integer Triton's clients read from it (the
    leading digits, as ``stoll``: ``1.0.0`` → ``1``): perf_analyzer given
    ``-x 1.0.0`` looks the figures up under ``"1.0.0"`` and then under
    ``"1"``, and fails unless both are there.
    """
    if not asked:
        return [triton_label(version, number)]
    labels = [asked]
    lead = _LEADING_DIGITS_RE.match(asked)
    if lead is not None and str(int(lead.group())) != asked:
        labels.append(str(int(lead.group())))
    return labels


def downstream_version(asked: str, resolved: str) -> str:
    """The version to pin on the data path for a request that asked for `asked`
    and resolved to `resolved`: the version itself when the client named it by
    its number (the router and batchers know versions, not numbers), else what
    the client sent (an alias stays an alias for the router)."""
    if asked and asked != resolved and integer_version(asked) is not None:
        return resolved
    return asked


def check_version_text(text: str) -> None:
    """Refuse a version string that cannot name anything, with Triton's code
    and wording (its clients look for them).

    Raises:
        InvalidArgument: `text` is no version, alias or number.
    """
    if not _VERSION_TEXT_RE.match(text):
        raise InvalidArgument(
            f"failed to get model version from specified version string '{text}' "
            "(details: not a version, an alias or a version number), version should be "
            "an integral value > 0 or a semantic version such as '1.2.3'"
        )
