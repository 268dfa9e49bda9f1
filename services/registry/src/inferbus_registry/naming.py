"""What model names, versions, aliases and file paths may look like, and version order.

Names and versions become object-store keys (``models/<name>/<version>/...``)
and NATS subject tokens, so they are checked strictly before anything is
stored: no ``/``, no ``..``, nothing hidden.
"""

from __future__ import annotations

import re

from inferbus_common.errors import InvalidArgument

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
_NUM = r"(?:0|[1-9][0-9]*)"
_IDENT = r"[0-9A-Za-z-]+"
VERSION_RE = re.compile(
    rf"^(?P<release>{_NUM}(?:\.{_NUM}){{0,2}})"
    rf"(?:-(?P<pre>{_IDENT}(?:\.{_IDENT})*))?"
    rf"(?:\+(?P<build>{_IDENT}(?:\.{_IDENT})*))?$"
)
_PATH_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,254}$")

RESERVED_FILES = frozenset({"config.json", "manifest.json"})
"""Files the registry writes itself; a push may not send them as chunks."""

MANAGED_ALIASES = frozenset({"latest"})
"""Aliases the registry moves by itself (``latest`` = highest version)."""


def check_model_name(name: str) -> str:
    """Return `name` if it is a valid model name.

    Raises:
        InvalidArgument: explaining the rule.
    """
    if not MODEL_NAME_RE.match(name) or ".." in name:
        raise InvalidArgument(
            f"invalid model name {name!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit, without '/' or '..'"
        )
    return name


def check_version(version: str) -> str:
    """Return `version` if it is a semantic version (``1``, ``1.2``, ``1.2.3-rc.1``).

    Raises:
        InvalidArgument: explaining the rule.
    """
    if len(version) > 64 or not VERSION_RE.match(version):
        raise InvalidArgument(
            f"invalid version {version!r}: expected a semantic version such as "
            "'1', '1.2', '1.2.3' or '1.2.3-rc.1'"
        )
    return version


def check_alias(alias: str) -> str:
    """Return `alias` if it is a valid alias name (a letter first; never a version).

    Raises:
        InvalidArgument: explaining the rule.
    """
    if not ALIAS_RE.match(alias):
        raise InvalidArgument(
            f"invalid alias {alias!r}: use a letter followed by letters, digits, '_' or '-'"
        )
    if alias in MANAGED_ALIASES:
        raise InvalidArgument(
            f"alias {alias!r} is managed by the registry (it always names the highest version)"
        )
    return alias


def check_file_path(path: str) -> str:
    """Return `path` if it is a safe relative path inside a version.

    Sub-directories are allowed (an LLM directory has them); absolute paths,
    ``..``, empty or hidden segments and backslashes are not.

    Raises:
        InvalidArgument: explaining the rule.
    """
    parts = path.split("/")
    if not path or len(path) > 1024 or not all(_PATH_PART_RE.match(p) for p in parts):
        raise InvalidArgument(
            f"invalid file path {path!r}: use a relative path of letters, digits and "
            "'_', '-', '.', '+', '=', '@' (no '..', no leading '/' or '.', no '\\')"
        )
    if path in RESERVED_FILES:
        raise InvalidArgument(
            f"file {path!r} is written by the registry; send config.json in the push header"
        )
    return path


def _pre_key(pre: str) -> tuple[tuple[int, int, str], ...]:
    # Semver precedence: numeric identifiers sort numerically and below
    # alphanumeric ones.
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split("."))


def version_key(version: str) -> tuple[object, ...]:
    """Sort key giving semantic-version precedence.

    ``1`` and ``1.0.0`` have the same precedence and are then ordered by their
    text so that the order is total. A pre-release sorts below its release.
    """
    m = VERSION_RE.match(version)
    if m is None:
        # Foreign directories in the store sort first and never become `latest`.
        return ((-1,), (), version)
    release = [int(x) for x in m.group("release").split(".")]
    release += [0] * (3 - len(release))
    pre = m.group("pre")
    pre_key: tuple[object, ...] = (1,) if pre is None else (0, _pre_key(pre))
    return (tuple(release), pre_key, version)


def highest_version(versions: list[str]) -> str:
    """The highest of `versions` by semantic-version precedence."""
    return max(versions, key=version_key)


def sort_versions(versions: list[str]) -> list[str]:
    """`versions` in ascending semantic-version order."""
    return sorted(versions, key=version_key)
