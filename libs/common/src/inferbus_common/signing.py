"""Ed25519 signatures over a model version's files.

The registry signs, at push time, the canonical JSON of the version's model
name, version and the SHA-256 of every file; the signature travels in
`manifest.json` and in the catalog record (`DeployedVersion.signature`,
`key_id`). A worker rebuilds the same payload from the catalog record, checks
the signature against its trusted public keys (several, so keys can rotate),
then checks every downloaded file against its SHA-256. A flipped byte in a
stored file, an edited catalog entry, or a signature from an unknown key is
refused before anything is loaded.

Keys: a private key is a PEM file (PKCS#8, Ed25519). A trusted public key is
written ``<key_id>=<base64 of the 32 raw bytes>``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

ALGORITHM = "ed25519"


class SignatureError(Exception):
    """A version's signature is missing, from an untrusted key, or does not verify."""


def signed_payload(model: str, version: str, files: Mapping[str, str]) -> bytes:
    """The exact bytes that are signed: canonical JSON of model, version, file digests."""
    doc = {"model": model, "version": version, "files": dict(sorted(files.items()))}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def generate_key() -> tuple[bytes, str]:
    """A new key pair: (private key PEM, public key as base64 raw bytes)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem, public_key_b64(key)


def public_key_b64(key: Ed25519PrivateKey) -> str:
    """Base64 of the raw 32-byte public key of a private key."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read an Ed25519 private key (PEM, unencrypted).

    Raises:
        ValueError: the file does not hold an Ed25519 private key.
    """
    key = serialization.load_pem_private_key(path.expanduser().read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def sign(key: Ed25519PrivateKey, payload: bytes) -> str:
    """Base64 Ed25519 signature of `payload`."""
    return base64.b64encode(key.sign(payload)).decode()


def parse_trusted_keys(specs: Iterable[str]) -> dict[str, Ed25519PublicKey]:
    """Trusted keys from ``<key_id>=<base64 raw public key>`` strings.

    Raises:
        ValueError: naming the malformed entry.
    """
    out: dict[str, Ed25519PublicKey] = {}
    for spec in specs:
        key_id, sep, b64 = spec.partition("=")
        if not sep or not key_id:
            raise ValueError(f"trusted key {spec!r} is not '<key_id>=<base64 public key>'")
        try:
            raw = base64.b64decode(b64, validate=True)
            out[key_id] = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError as exc:
            raise ValueError(f"trusted key {key_id!r} is not a base64 Ed25519 key: {exc}") from None
    return out


def verify(
    trusted: Mapping[str, Ed25519PublicKey], key_id: str, signature: str, payload: bytes
) -> None:
    """Check a signature against the trusted keys.

    Raises:
        SignatureError: unsigned, unknown key, or a signature that does not verify.
    """
    if not signature:
        raise SignatureError("the version is not signed")
    key = trusted.get(key_id)
    if key is None:
        raise SignatureError(f"signed with key {key_id!r}, which is not trusted")
    try:
        key.verify(base64.b64decode(signature), payload)
    except (InvalidSignature, ValueError):
        raise SignatureError(
            f"signature by key {key_id!r} does not match the files' digests (tampered?)"
        ) from None
