"""Ed25519 signatures over a version's file digests."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization

from inferbus_common.signing import (
    SignatureError,
    generate_key,
    parse_trusted_keys,
    sign,
    signed_payload,
    verify,
)

FILES = {"model.onnx": "a" * 64, "config.json": "b" * 64}


def _key():
    pem, pub = generate_key()
    return serialization.load_pem_private_key(pem, password=None), pub


def test_sign_and_verify_with_rotated_keys() -> None:
    old, old_pub = _key()
    new, new_pub = _key()
    trusted = parse_trusted_keys([f"k1={old_pub}", f"k2={new_pub}"])
    payload = signed_payload("fraud", "1", FILES)
    verify(trusted, "k1", sign(old, payload), payload)
    verify(trusted, "k2", sign(new, payload), payload)


def test_payload_is_canonical() -> None:
    assert signed_payload("m", "1", {"b": "2", "a": "1"}) == signed_payload(
        "m", "1", {"a": "1", "b": "2"}
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda sig, files: (sig, {**files, "model.onnx": "c" * 64}), "does not match"),
        (lambda sig, files: ("", files), "not signed"),
    ],
)
def test_tampering_is_refused(mutate, message: str) -> None:
    key, pub = _key()
    trusted = parse_trusted_keys([f"k={pub}"])
    sig = sign(key, signed_payload("fraud", "1", FILES))
    sig2, files2 = mutate(sig, FILES)
    with pytest.raises(SignatureError, match=message):
        verify(trusted, "k", sig2, signed_payload("fraud", "1", files2))


def test_untrusted_key_is_refused() -> None:
    key, _ = _key()
    _, other_pub = _key()
    payload = signed_payload("fraud", "1", FILES)
    with pytest.raises(SignatureError, match="not trusted"):
        verify(parse_trusted_keys([f"k={other_pub}"]), "evil", sign(key, payload), payload)
    # Same id, different key: the signature does not verify.
    with pytest.raises(SignatureError, match="does not match"):
        verify(parse_trusted_keys([f"k={other_pub}"]), "k", sign(key, payload), payload)


@pytest.mark.parametrize("spec", ["no-equals", "=abc", "k=not base64!"])
def test_malformed_trusted_keys(spec: str) -> None:
    with pytest.raises(ValueError, match="trusted key"):
        parse_trusted_keys([spec])
