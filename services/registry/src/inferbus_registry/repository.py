"""The model repository: versions, manifests and aliases on top of a `Store`.

`ModelRepository` reads versions and routes here; its aliases and serving
lifecycle are in `inferbus_registry.lifecycle`, its push in
`inferbus_registry.push`, the storage layout (keys, config.json,
manifest.json) in `inferbus_registry.layout` and the records it returns in
`inferbus_registry.records`.

This module knows nothing about gRPC or NATS; the service layer maps its
typed errors to status codes and publishes what it returns.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from inferbus_common.catalog import Route
from inferbus_common.errors import NotFound
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.versionnumbers import find_by_number, integer_version
from inferbus_registry import naming, numbering
from inferbus_registry.integrity import verify_artifact
from inferbus_registry.layout import (
    ALIASES_FILE,
    ARCHIVED_FILE,
    CONFIG_FILE,
    MANIFEST_FILE,
    ROOT,
    UNLOADED_FILE,
    version_prefix,
)
from inferbus_registry.lifecycle import ModelLifecycle
from inferbus_registry.profilecheck import PROFILE_FILE
from inferbus_registry.push import VersionPush
from inferbus_registry.records import FileInfo, ModelState, VersionRecord
from inferbus_registry.sklearnconvert import ConversionLimits
from inferbus_registry.store import Store

log = logging.getLogger(__name__)


class ModelRepository(ModelLifecycle, VersionPush):
    """Versions and aliases of every model, kept in a `Store`.

    Args:
        store: where files live.
        spool_dir: where pushed files wait while being checked (None = the
            system temp dir); it needs room for the largest push.
        max_push_bytes: a push sending more is refused.
        signing_key: signs every pushed version (None: unsigned).
        signing_key_id: the name recorded with each signature.
        trusted_keys: other keys whose signatures `verify` accepts (rotation).
        conversion: limits of converting a pushed scikit-learn pickle
            (`sklearnconvert`; default: on, with its defaults).
    """

    def __init__(
        self,
        store: Store,
        *,
        spool_dir: Path | None = None,
        max_push_bytes: int = 16 << 30,
        signing_key: Ed25519PrivateKey | None = None,
        signing_key_id: str = "",
        trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
        conversion: ConversionLimits | None = None,
    ) -> None:
        self.store = store
        self._signing_key = signing_key
        self._signing_key_id = signing_key_id
        self._verify_keys: dict[str, Ed25519PublicKey] = dict(trusted_keys or {})
        if signing_key is not None:
            self._verify_keys[signing_key_id] = signing_key.public_key()
        self._spool_dir = spool_dir
        self._max_push = max_push_bytes
        self._conversion = conversion or ConversionLimits()
        self._conversion_slots = asyncio.Semaphore(self._conversion.concurrency)
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, model: str) -> asyncio.Lock:
        # Pushes and alias changes of one model are serialised in this process.
        return self._locks.setdefault(model, asyncio.Lock())

    # --- reading -------------------------------------------------------------
    async def model_names(self) -> list[str]:
        """Every model that has at least one complete version, sorted."""
        names = set()
        for key in await self.store.list(f"{ROOT}/"):
            parts = key.split("/")
            if len(parts) == 4 and parts[3] == MANIFEST_FILE:
                names.add(parts[1])
        return sorted(names)

    async def versions(self, model: str) -> list[str]:
        """Complete versions of `model`, ascending."""
        found = []
        for key in await self.store.list(f"{ROOT}/{model}/"):
            parts = key.split("/")
            if len(parts) == 4 and parts[3] == MANIFEST_FILE:
                found.append(parts[2])
        return naming.sort_versions(found)

    async def aliases(self, model: str) -> dict[str, str]:
        """The model's aliases (empty when it has none)."""
        try:
            doc = await self.store.read_json(f"{ROOT}/{model}/{ALIASES_FILE}")
        except NotFound:
            return {}
        return {str(k): str(v) for k, v in dict(doc.get("aliases", {})).items()}

    async def state(self, model: str) -> ModelState:
        """Versions and aliases of `model`.

        Raises:
            NotFound: when the model has no version.
        """
        naming.check_model_name(model)
        keys = await self.store.list(f"{ROOT}/{model}/")
        versions, archived = [], []
        for key in keys:
            parts = key.split("/")
            if len(parts) == 4 and parts[3] == MANIFEST_FILE:
                versions.append(parts[2])
            elif len(parts) == 4 and parts[3] == ARCHIVED_FILE:
                archived.append(parts[2])
        if not versions:
            raise NotFound(f"no model {model!r}")
        versions = naming.sort_versions(versions)
        return ModelState(
            name=model,
            versions=versions,
            aliases=await self.aliases(model),
            archived=[v for v in versions if v in set(archived)],
            unloaded=f"{ROOT}/{model}/{UNLOADED_FILE}" in keys,
        )

    async def list_models(self) -> list[ModelState]:
        """Every model with its versions and aliases."""
        return [await self.state(name) for name in await self.model_names()]

    async def resolve(self, model: str, version_or_alias: str) -> str:
        """The version a version number or alias names (empty = ``stable``).

        Raises:
            NotFound: unknown model, alias or version.
            InvalidArgument: a malformed name.
        """
        naming.check_model_name(model)
        ref = version_or_alias or "stable"
        if naming.ALIAS_RE.match(ref):
            aliases = await self.aliases(model)
            if ref not in aliases:
                if not await self.versions(model):
                    raise NotFound(f"no model {model!r}")
                raise NotFound(f"model {model!r} has no alias {ref!r}; aliases: {sorted(aliases)}")
            return aliases[ref]
        naming.check_version(ref)
        if integer_version(ref) is not None and not await self.store.exists(
            f"{version_prefix(model, ref)}/{MANIFEST_FILE}"
        ):
            # Not a version's name: maybe a version's number (Triton's tools).
            found = find_by_number(ref, (await self.numbers(model)).items())
            if found is not None:
                return found
        return ref

    async def numbers(self, model: str) -> dict[str, int]:
        """Version → Triton-style number of every complete version of `model`."""
        return await numbering.version_numbers(
            self.store, f"{ROOT}/{model}", await self.versions(model)
        )

    async def get_version(self, model: str, version_or_alias: str = "") -> VersionRecord:
        """A stored version by number or alias (empty = ``stable``).

        Raises:
            NotFound: unknown model, alias or version.
        """
        version = await self.resolve(model, version_or_alias)
        prefix = version_prefix(model, version)
        try:
            manifest_json = await self.store.read_bytes(f"{prefix}/{MANIFEST_FILE}")
        except NotFound:
            raise NotFound(f"model {model!r} has no version {version!r}") from None
        config_json = await self.store.read_bytes(f"{prefix}/{CONFIG_FILE}")
        manifest = json.loads(manifest_json)
        profile_json = b""
        if PROFILE_FILE in manifest["files"]:
            profile_json = await self.store.read_bytes(f"{prefix}/{PROFILE_FILE}")
        return VersionRecord(
            model=model,
            version=version,
            config=ModelConfig.model_validate_json(config_json),
            config_json=config_json,
            manifest_json=manifest_json,
            digest=hashlib.sha256(manifest_json).hexdigest(),
            files={
                path: FileInfo(sha256=str(f["sha256"]), size=int(f["size"]))
                for path, f in manifest["files"].items()
            },
            created_unix_ms=int(manifest.get("created_unix_ms", 0)),
            signature=(manifest.get("signature") or {}).get("value", ""),
            key_id=(manifest.get("signature") or {}).get("key_id", ""),
            profile_json=profile_json,
            number=numbering.manifest_number(manifest, version),
        )

    async def verify(self, model: str, version_or_alias: str) -> VersionRecord:
        """A stored version whose files match its manifest and whose signature verifies
        (when the registry knows any key): the check before it may take traffic.

        Raises:
            NotFound: unknown model, alias or version.
            FailedPrecondition: naming the mismatch (`integrity.verify_artifact`).
        """
        record = await self.get_version(model, version_or_alias)
        await verify_artifact(
            self.store,
            version_prefix(model, record.version),
            model=model,
            version=record.version,
            files={p: (f.sha256, f.size) for p, f in record.files.items()},
            signature=record.signature,
            key_id=record.key_id,
            keys=self._verify_keys,
        )
        return record

    async def open_file(
        self, model: str, version_or_alias: str, path: str, chunk_size: int
    ) -> tuple[VersionRecord, AsyncIterator[bytes]]:
        """A file of a version as a stream of chunks.

        `manifest.json` itself and every file it lists can be read.

        Raises:
            NotFound: unknown model, version or path.
        """
        record = await self.get_version(model, version_or_alias)
        if path != MANIFEST_FILE and path not in record.files:
            raise NotFound(
                f"model {model!r} version {record.version!r} has no file {path!r}; "
                f"files: {sorted(record.files)}"
            )
        key = f"{version_prefix(model, record.version)}/{path}"
        return record, self.store.get(key, chunk_size)

    async def route(self, state: ModelState) -> Route | None:
        """The routing table for a model (None before it has a ``stable`` alias)."""
        stable = state.aliases.get("stable")
        if stable is None or state.unloaded:
            return None
        pool = (await self.get_version(state.name, stable)).config.pool
        return Route(
            model=state.name,
            stable=stable,
            versions=state.active_versions(),
            aliases=dict(sorted(state.aliases.items())),
            pool=pool,
        )
