"""Artifact checks before a version may take traffic: stored files against the
manifest's SHA-256, and the manifest's signature against the keys the registry knows.

Run before an alias, a route (canary, shadow) or a rollout points at a version,
so a corrupt or foreign artifact is refused with FAILED_PRECONDITION naming
what does not match, instead of being found out by the workers while traffic
moves. See docs/architecture.md ("Registry and artifacts").
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from inferbus_common.errors import FailedPrecondition, NotFound
from inferbus_common.signing import SignatureError, signed_payload, verify
from inferbus_registry.store import Store

log = logging.getLogger(__name__)


async def stored_sha256(store: Store, key: str) -> tuple[str, int]:
    """SHA-256 (hex) and size of a stored file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    async for chunk in store.get(key):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


async def verify_artifact(
    store: Store,
    prefix: str,
    *,
    model: str,
    version: str,
    files: Mapping[str, tuple[str, int]],
    signature: str,
    key_id: str,
    keys: Mapping[str, Ed25519PublicKey],
) -> None:
    """Check every file of a stored version, then its signature.

    Args:
        store: where the files are.
        prefix: the version's folder in the store (``models/<name>/<version>``).
        model: model name (part of the signed payload).
        version: version (part of the signed payload).
        files: path → (SHA-256, size) as the manifest lists them.
        signature: the manifest's signature ('' when unsigned).
        key_id: the key that signed it.
        keys: public keys the registry knows (its own and trusted ones); none:
            the signature is not checked (workers without trusted keys do not
            check it either).

    Raises:
        FailedPrecondition: naming the file whose digest or size differs, a
            missing file, or the signature problem.
    """
    where = f"model {model!r} version {version!r}"
    for path, (sha, size) in sorted(files.items()):
        try:
            actual, actual_size = await stored_sha256(store, f"{prefix}/{path}")
        except NotFound:
            raise FailedPrecondition(
                f"{where}: file {path!r} listed in its manifest is missing from the store; "
                "push the model again as a new version"
            ) from None
        if actual != sha or actual_size != size:
            log.error(
                "stored artifact does not match its manifest: %s", path, extra={"model": model}
            )
            raise FailedPrecondition(
                f"{where}: stored file {path!r} does not match its manifest (SHA-256 "
                f"{actual[:16]}…, {actual_size} bytes; manifest {sha[:16]}…, {size} bytes): "
                "the stored artifact is corrupt; push the model again as a new version"
            )
    if not keys:
        return
    payload = signed_payload(model, version, {p: sha for p, (sha, _) in files.items()})
    try:
        verify(keys, key_id, signature, payload)
    except SignatureError as exc:
        raise FailedPrecondition(f"{where}: {exc}; workers that verify will refuse it") from None
