"""`ServiceSettings.nats_auth`: where the NATS password comes from."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferbus_common.settings import ServiceSettings


def test_no_user_sends_no_credentials(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret")
    assert ServiceSettings(nats_password="x", nats_password_file=pw).nats_auth() == {}


def test_password_file_is_stripped_and_preferred(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("  from-file\n")
    settings = ServiceSettings(nats_user="worker", nats_password="value", nats_password_file=pw)
    assert settings.nats_auth() == {"user": "worker", "password": "from-file"}


def test_password_value_without_a_file() -> None:
    settings = ServiceSettings(nats_user="worker", nats_password="value")
    assert settings.nats_auth() == {"user": "worker", "password": "value"}


def test_empty_password_is_still_sent(tmp_path: Path) -> None:
    # nats-py sends the user only together with a password: an empty file or
    # value must still give one, or the server would see an anonymous client.
    pw = tmp_path / "pw"
    pw.write_text("\n")
    by_file = ServiceSettings(nats_user="worker", nats_password_file=pw).nats_auth()
    by_value = ServiceSettings(nats_user="worker", nats_password="").nats_auth()
    assert by_file == by_value == {"user": "worker", "password": ""}


def test_user_without_a_password() -> None:
    assert ServiceSettings(nats_user="worker").nats_auth() == {"user": "worker"}


def test_unreadable_password_file_raises(tmp_path: Path) -> None:
    settings = ServiceSettings(nats_user="worker", nats_password_file=tmp_path / "missing")
    with pytest.raises(OSError):
        settings.nats_auth()


def test_creds_and_tls_files_are_passed_as_paths(tmp_path: Path) -> None:
    settings = ServiceSettings(
        nats_creds_file=tmp_path / "user.creds", nats_tls_ca_file=tmp_path / "ca.pem"
    )
    assert settings.nats_auth() == {
        "user_credentials": str(tmp_path / "user.creds"),
        "tls_ca_file": str(tmp_path / "ca.pem"),
    }
