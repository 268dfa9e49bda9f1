"""`GatewaySettings.redis_secret`: where the Redis password comes from."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferbus_gateway.settings import GatewaySettings


def test_password_file_is_stripped_and_preferred(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    settings = GatewaySettings(redis_password="value", redis_password_file=pw)
    assert settings.redis_secret() == "from-file"


def test_password_value_and_none() -> None:
    assert GatewaySettings(redis_password="value").redis_secret() == "value"
    assert GatewaySettings().redis_secret() is None


def test_empty_password_file_gives_no_password(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("\n")
    assert not GatewaySettings(redis_password_file=pw).redis_secret()


def test_unreadable_password_file_raises(tmp_path: Path) -> None:
    settings = GatewaySettings(redis_password_file=tmp_path / "missing")
    with pytest.raises(OSError):
        settings.redis_secret()
