"""Names, versions, aliases and paths the registry accepts, and version order."""

from __future__ import annotations

import pytest

from inferbus_common.errors import InvalidArgument
from inferbus_registry import naming


@pytest.mark.parametrize("version", ["1", "1.2", "1.2.3", "0.1.0", "1.2.3-rc.1", "2.0.0-beta+b7"])
def test_valid_versions(version: str) -> None:
    assert naming.check_version(version) == version


@pytest.mark.parametrize(
    "version", ["", "v1", "1.2.3.4", "01", "1..2", "../1", "1/2", "1.2.3-", "latest", "1 "]
)
def test_invalid_versions(version: str) -> None:
    with pytest.raises(InvalidArgument, match="semantic version"):
        naming.check_version(version)


@pytest.mark.parametrize("name", ["fraud", "Fraud-v2", "a.b_c", "7up"])
def test_valid_model_names(name: str) -> None:
    assert naming.check_model_name(name) == name


@pytest.mark.parametrize("name", ["", "../etc", "a/b", "a..b", ".hidden", "-x", "a b", "x" * 200])
def test_invalid_model_names(name: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid model name"):
        naming.check_model_name(name)


@pytest.mark.parametrize("path", ["model.onnx", "tokenizer/vocab.json", "weights/part-00001.bin"])
def test_valid_file_paths(path: str) -> None:
    assert naming.check_file_path(path) == path


@pytest.mark.parametrize(
    "path", ["", "/etc/passwd", "../x", "a/../../x", "a//b", ".env", "a\\b", "a/./b"]
)
def test_path_traversal_is_refused(path: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid file path"):
        naming.check_file_path(path)


def test_reserved_files_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="push header"):
        naming.check_file_path("config.json")


def test_aliases() -> None:
    assert naming.check_alias("canary") == "canary"
    with pytest.raises(InvalidArgument, match="managed by the registry"):
        naming.check_alias("latest")
    with pytest.raises(InvalidArgument, match="invalid alias"):
        naming.check_alias("1.0")


def test_semver_precedence() -> None:
    ordered = [
        "0.9",
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0",
        "1.2",
        "1.10.0",
        "2",
    ]
    assert naming.sort_versions(list(reversed(ordered))) == ordered
    assert naming.highest_version(["1.9.9", "1.10.0", "1.10.0-rc.1"]) == "1.10.0"
