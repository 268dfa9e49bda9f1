"""The model repository: versions, manifests and aliases on top of a `Store`.

Layout (see docs/architecture.md)::

    models/<name>/<version>/<file>          # model.onnx, or any artifact files
    models/<name>/<version>/config.json     # the version's ModelConfig
    models/<name>/<version>/manifest.json   # sha256 + size of every file, signature
    models/<name>/aliases.json              # {"model": ..., "aliases": {alias: version}}
    models/<name>/numbers.json              # {"highest": n}: version numbers (`numbering`)

A version exists once its `manifest.json` exists: it is written last, so an
interrupted push leaves files without a manifest, which a later push of the
same version simply overwrites. Versions are immutable after that.

This module knows nothing about gRPC or NATS; the service layer maps its
typed errors to status codes and publishes what it returns.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from inferbus_common.catalog import DeployedVersion, Route
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_common.imageformat import complete_formats
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.signing import ALGORITHM, sign, signed_payload
from inferbus_common.versionnumbers import find_by_number, integer_version, next_number
from inferbus_registry import naming, numbering
from inferbus_registry.integrity import verify_artifact
from inferbus_registry.onnxcheck import check_onnx, derive_config
from inferbus_registry.processingcheck import check_label_files, check_processing
from inferbus_registry.profilecheck import PROFILE_FILE, check_profile
from inferbus_registry.store import Store

log = logging.getLogger(__name__)

ROOT = "models"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
ALIASES_FILE = "aliases.json"
ARCHIVED_FILE = "archived.json"
"""Marker in a version's folder: the version is archived (kept, never served)."""
UNLOADED_FILE = "unloaded.json"
"""Marker in a model's folder: the model is out of serving (its route is withdrawn)."""


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file of a version as recorded in its manifest."""

    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """A stored version: its config, manifest and digest."""

    model: str
    version: str
    config: ModelConfig
    config_json: bytes
    manifest_json: bytes
    digest: str
    """SHA-256 (hex) of `manifest_json`."""
    files: dict[str, FileInfo]
    created_unix_ms: int
    signature: str = ""
    """Base64 Ed25519 signature of the files' digests (empty: unsigned)."""
    key_id: str = ""
    profile_json: bytes = b""
    """The version's drift reference (``profile.json``) when it has one, else empty."""
    number: int = 0
    """Triton-style number (`numbering`; 0: none recorded and not an integer version)."""

    def deployed(self) -> DeployedVersion:
        """The catalog record published in the models KV bucket."""
        return DeployedVersion(
            model=self.model,
            version=self.version,
            config=self.config,
            digest=self.digest,
            files={path: info.sha256 for path, info in self.files.items()},
            created_unix_ms=self.created_unix_ms,
            signature=self.signature,
            key_id=self.key_id,
            number=self.number,
        )


@dataclass(slots=True)
class ModelState:
    """A model's versions (ascending) and aliases."""

    name: str
    versions: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    archived: list[str] = field(default_factory=list)
    """Versions kept in the store but out of serving (subset of `versions`)."""
    unloaded: bool = False
    """The model was taken out of serving: it has no route until loaded again."""

    def active_versions(self) -> list[str]:
        """Versions that may be aliased and routed (not archived), ascending."""
        archived = set(self.archived)
        return [v for v in self.versions if v not in archived]


@dataclass(frozen=True, slots=True)
class PushResult:
    """What a push did."""

    record: VersionRecord
    state: ModelState
    created: bool
    """False when the version already existed with the same content (a retry)."""
    bytes_stored: int


def _version_prefix(model: str, version: str) -> str:
    return f"{ROOT}/{model}/{version}"


def parse_config(config_json: bytes, model: str) -> ModelConfig:
    """Parse a version's config.json, filling its `name` from the push.

    Raises:
        InvalidArgument: when the JSON is malformed, does not fit the schema, or
            names another model.
    """
    if not config_json.strip():
        raise InvalidArgument(f"{model}: config.json is missing from the push header")
    try:
        raw = json.loads(config_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{model}: config.json is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{model}: config.json must be a JSON object")
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise InvalidArgument(f"{model}: config.json is invalid: {problems}") from exc
    if not config.name:
        config = config.model_copy(update={"name": model})
    elif config.name != model:
        raise InvalidArgument(
            f"config.json names model {config.name!r} but the push is for {model!r}"
        )
    return config


def canonical_config_json(config: ModelConfig) -> bytes:
    """The exact bytes stored as config.json (stable, so retries hash the same)."""
    return (json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


def build_manifest(
    model: str,
    version: str,
    files: dict[str, FileInfo],
    created_unix_ms: int,
    signature: dict[str, str] | None = None,
    number: int = 0,
) -> bytes:
    """manifest.json bytes; `signature` is null when the registry has no signing key;
    `number` is the version's Triton-style number (`numbering`), left out when 0."""
    doc: dict[str, Any] = {
        "model": model,
        "version": version,
        "files": {
            path: {"sha256": info.sha256, "size": info.size} for path, info in sorted(files.items())
        },
        "created_unix_ms": created_unix_ms,
        "signature": signature,
    }
    if number:
        doc[numbering.MANIFEST_KEY] = number
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


class _Spool:
    """Incoming files written to a temporary directory while their SHA-256 is computed."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self._max = max_bytes
        self.total = 0
        self._open: dict[str, tuple[IO[bytes], Any]] = {}
        self.files: dict[str, FileInfo] = {}

    def path(self, rel: str) -> Path:
        return self.root.joinpath(*rel.split("/"))

    def write(self, rel: str, data: bytes) -> None:
        if rel in self.files:
            raise InvalidArgument(f"file {rel!r} was sent again after another file")
        self.total += len(data)
        if self.total > self._max:
            raise InvalidArgument(f"push exceeds the registry's limit of {self._max} bytes")
        entry = self._open.get(rel)
        if entry is None:
            # A file's chunks come in a row: starting another file closes this one.
            self._close_all()
            dest = self.path(rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            entry = (dest.open("wb"), hashlib.sha256())
            self._open[rel] = entry
        fh, digest = entry
        fh.write(data)
        digest.update(data)

    def _close_all(self) -> None:
        for rel, (fh, digest) in self._open.items():
            fh.close()
            size = self.path(rel).stat().st_size
            self.files[rel] = FileInfo(sha256=digest.hexdigest(), size=size)
        self._open.clear()

    def finish(self) -> dict[str, FileInfo]:
        self._close_all()
        return dict(self.files)

    def abort(self) -> None:
        for fh, _ in self._open.values():
            fh.close()
        self._open.clear()


class ModelRepository:
    """Versions and aliases of every model, kept in a `Store`.

    Args:
        store: where files live.
        spool_dir: where pushed files wait while being checked (None = the
            system temp dir); it needs room for the largest push.
        max_push_bytes: a push sending more is refused.
        signing_key: signs every pushed version (None: unsigned).
        signing_key_id: the name recorded with each signature.
        trusted_keys: other keys whose signatures `verify` accepts (rotation).
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
    ) -> None:
        self.store = store
        self._signing_key = signing_key
        self._signing_key_id = signing_key_id
        self._verify_keys: dict[str, Ed25519PublicKey] = dict(trusted_keys or {})
        if signing_key is not None:
            self._verify_keys[signing_key_id] = signing_key.public_key()
        self._spool_dir = spool_dir
        self._max_push = max_push_bytes
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
            f"{_version_prefix(model, ref)}/{MANIFEST_FILE}"
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
        prefix = _version_prefix(model, version)
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
            _version_prefix(model, record.version),
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
        key = f"{_version_prefix(model, record.version)}/{path}"
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

    # --- writing -------------------------------------------------------------
    async def _write_aliases(self, model: str, aliases: dict[str, str]) -> None:
        doc = {"model": model, "aliases": dict(sorted(aliases.items()))}
        await self.store.write_bytes(
            f"{ROOT}/{model}/{ALIASES_FILE}", (json.dumps(doc, indent=2) + "\n").encode()
        )

    async def set_alias(self, model: str, alias: str, version: str) -> ModelState:
        """Point `alias` at an existing `version`.

        Raises:
            InvalidArgument: malformed alias or version, or a managed alias.
            NotFound: unknown model or version.
        """
        naming.check_model_name(model)
        naming.check_alias(alias)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            if version in state.archived:
                raise FailedPrecondition(
                    f"model {model!r} version {version!r} is archived; run "
                    f"`inferbus models unarchive {model} {version}` before aliasing it"
                )
            state.aliases[alias] = version
            await self._write_aliases(model, state.aliases)
            return state

    # --- archive, delete, serving (lifecycle) ----------------------------------
    async def _archived(self, model: str) -> set[str]:
        return {
            key.split("/")[2]
            for key in await self.store.list(f"{ROOT}/{model}/")
            if len(key.split("/")) == 4 and key.split("/")[3] == ARCHIVED_FILE
        }

    async def _check_not_serving(
        self, state: ModelState, version: str, action: str, live: Route | None
    ) -> None:
        """Refuse `action` while anything routes to `version`.

        ``latest`` is not a reason: the registry moves it by itself (to the
        highest remaining active version). The route's canary and shadow live
        only in NATS KV, so the caller passes the `live` route read there.

        Raises:
            FailedPrecondition: naming the alias or route field that points at it.
        """
        holders = sorted(a for a, v in state.aliases.items() if v == version and a != "latest")
        routed = live
        if routed is not None:
            for field_name in ("canary", "shadow"):
                if getattr(routed, field_name, "") == version:
                    holders.append(f"route.{field_name}")
        if holders:
            what = ", ".join(h if h.startswith("route.") else f"alias {h!r}" for h in holders)
            raise FailedPrecondition(
                f"cannot {action} model {state.name!r} version {version!r}: it is in use "
                f"({what}); point those at another version first (`inferbus models alias`)"
            )

    async def _state_with(self, model: str, version: str) -> ModelState:
        """The model's state, which must hold `version`.

        Raises:
            NotFound: unknown model or version.
        """
        state = await self.state(model)
        if version not in state.versions:
            raise NotFound(
                f"model {model!r} has no version {version!r}; versions: {state.versions}"
            )
        return state

    def _relatest(self, state: ModelState) -> dict[str, str]:
        aliases = dict(state.aliases)
        active = state.active_versions()
        if active:
            aliases["latest"] = naming.highest_version(active)
        else:
            aliases.pop("latest", None)
        return aliases

    async def archive(
        self, model: str, version: str, requested_by: str = "", *, live: Route | None = None
    ) -> ModelState:
        """Take `version` out of serving, keeping its files (idempotent).

        `live` is the model's route as published (its canary and shadow count).

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is stable, an alias target, the
                route's canary or shadow.
        """
        naming.check_model_name(model)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            if version in state.archived:
                return state
            await self._check_not_serving(state, version, "archive", live)
            doc = {
                "model": model,
                "version": version,
                "archived_unix_ms": time.time_ns() // 1_000_000,
                "requested_by": requested_by,
            }
            await self.store.write_bytes(
                f"{_version_prefix(model, version)}/{ARCHIVED_FILE}",
                (json.dumps(doc, indent=2) + "\n").encode(),
            )
            state.archived = naming.sort_versions([*state.archived, version])
            return await self._store_aliases(state)

    async def unarchive(self, model: str, version: str) -> ModelState:
        """Make an archived `version` usable again (idempotent).

        Raises:
            NotFound: unknown model or version.
        """
        naming.check_model_name(model)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            if version not in state.archived:
                return state
            await self.store.delete(f"{_version_prefix(model, version)}/{ARCHIVED_FILE}")
            state.archived = [v for v in state.archived if v != version]
            return await self._store_aliases(state)

    async def delete_version(
        self, model: str, version: str, *, live: Route | None = None
    ) -> tuple[ModelState, int]:
        """Remove a version's files from the store; returns the new state and bytes freed.

        The manifest goes first, so an interrupted delete leaves files that
        are no version (a later push of the same number overwrites them).
        When the last version goes, the model's aliases go too and the
        returned state has no versions.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is in use (see `archive`).
        """
        naming.check_model_name(model)
        naming.check_version(version)
        async with self._lock(model):
            state = await self._state_with(model, version)
            await self._check_not_serving(state, version, "delete", live)
            prefix = _version_prefix(model, version)
            try:
                freed = sum(
                    info.size for info in (await self.get_version(model, version)).files.values()
                )
            except (NotFound, ValueError, KeyError):
                freed = 0
            await self.store.delete(f"{prefix}/{MANIFEST_FILE}")
            for key in await self.store.list(f"{prefix}/"):
                await self.store.delete(key)
            state.versions = [v for v in state.versions if v != version]
            state.archived = [v for v in state.archived if v != version]
            if not state.versions:
                for name in (ALIASES_FILE, UNLOADED_FILE):
                    if await self.store.exists(f"{ROOT}/{model}/{name}"):
                        await self.store.delete(f"{ROOT}/{model}/{name}")
                state.aliases = {}
                return state, freed
            return await self._store_aliases(state), freed

    async def set_serving(
        self, model: str, serving: bool, version: str = "", requested_by: str = ""
    ) -> ModelState:
        """Withdraw a model's route (``serving=False``) or publish it again.

        With ``serving=True`` and a `version` (number or alias), ``stable``
        moves to that version first. Aliases survive an unload, so a load
        brings back exactly what served before.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: the version is archived.
        """
        naming.check_model_name(model)
        target = await self.resolve(model, version) if serving and version else ""
        async with self._lock(model):
            state = await self.state(model)
            marker = f"{ROOT}/{model}/{UNLOADED_FILE}"
            if target:
                if target not in state.versions:
                    raise NotFound(
                        f"model {model!r} has no version {target!r}; versions: {state.versions}"
                    )
                if target in state.archived:
                    raise FailedPrecondition(
                        f"model {model!r} version {target!r} is archived; unarchive it first"
                    )
                if state.aliases.get("stable") != target:
                    state.aliases["stable"] = target
                    await self._write_aliases(model, state.aliases)
            if serving and state.unloaded:
                await self.store.delete(marker)
            elif not serving and not state.unloaded:
                doc = {"model": model, "unloaded_unix_ms": time.time_ns() // 1_000_000}
                doc["requested_by"] = requested_by
                await self.store.write_bytes(marker, (json.dumps(doc) + "\n").encode())
            state.unloaded = not serving
            return state

    async def _store_aliases(self, state: ModelState) -> ModelState:
        aliases = self._relatest(state)
        if aliases != state.aliases:
            await self._write_aliases(state.name, aliases)
            state.aliases = aliases
        return state

    async def push(
        self,
        model: str,
        version: str,
        config_json: bytes,
        aliases: list[str],
        chunks: AsyncIterable[tuple[str, bytes]],
    ) -> PushResult:
        """Check and store a new version, then move its aliases.

        Args:
            model: model name.
            version: semantic version.
            config_json: the version's config.json.
            aliases: aliases to point at the version once stored.
            chunks: (path, data) pairs; a file's chunks come in a row.

        Returns:
            The stored version, the model's new state and whether it was new.

        Raises:
            InvalidArgument: a bad name, version, alias, path, config or model file.
            FailedPrecondition: the version exists with different content.
        """
        naming.check_model_name(model)
        naming.check_version(version)
        for alias in aliases:
            naming.check_alias(alias)
        # No config.json: derived from the ONNX file once it has arrived (Triton's
        # auto-complete); parsed first otherwise, so a bad one fails before the upload.
        derive = not config_json.strip()
        config = None if derive else parse_config(config_json, model)

        tmp = Path(
            await asyncio.to_thread(tempfile.mkdtemp, prefix="inferbus-push-", dir=self._spool_dir)
        )
        try:
            spool = _Spool(tmp, self._max_push)
            try:
                async for path, data in chunks:
                    naming.check_file_path(path)
                    await asyncio.to_thread(spool.write, path, data)
                files = await asyncio.to_thread(spool.finish)
            finally:
                spool.abort()
            if config is None:
                onnx_files = [f for f in files if f.endswith(".onnx")]
                if len(onnx_files) != 1:
                    raise InvalidArgument(
                        f"{model}: config.json is missing from the push and there is no single "
                        f".onnx file to derive it from (sent: {sorted(files)})"
                    )
                config = await asyncio.to_thread(derive_config, spool.path(onnx_files[0]), model)
            # Triton's auto-complete of image layouts the shape makes clear.
            config = complete_formats(config)
            stored_config = canonical_config_json(config)
            if config.file not in files:
                raise InvalidArgument(
                    f"{model}: config.json names file {config.file!r} but the push sent "
                    f"{sorted(files) or 'no files'}"
                )
            if config.platform == "onnxruntime_onnx" or config.file.endswith(".onnx"):
                # With processing the graph takes and gives the engine-facing tensors.
                await asyncio.to_thread(check_onnx, spool.path(config.file), config.engine_view())
            if config.processing is not None:
                await asyncio.to_thread(check_processing, config, files, spool.path)
            if config.label_files():
                await asyncio.to_thread(check_label_files, config, files, spool.path)
            if PROFILE_FILE in files:
                await asyncio.to_thread(check_profile, spool.path(PROFILE_FILE), config, model)
            files[CONFIG_FILE] = FileInfo(
                sha256=hashlib.sha256(stored_config).hexdigest(), size=len(stored_config)
            )
            async with self._lock(model):
                return await self._store_version(
                    model, version, config, stored_config, files, spool, aliases
                )
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)

    async def _store_version(
        self,
        model: str,
        version: str,
        config: ModelConfig,
        stored_config: bytes,
        files: dict[str, FileInfo],
        spool: _Spool,
        aliases: list[str],
    ) -> PushResult:
        prefix = _version_prefix(model, version)
        created = True
        stored = 0
        existing = None
        # By its exact name: an integer version that is not stored yet must not
        # resolve to the version that has it as its number.
        if await self.store.exists(f"{prefix}/{MANIFEST_FILE}"):
            try:
                existing = await self.get_version(model, version)
            except NotFound:
                existing = None
        if existing is not None:
            if existing.files != files:
                changed = sorted(
                    p
                    for p in set(existing.files) | set(files)
                    if existing.files.get(p) != files.get(p)
                )
                raise FailedPrecondition(
                    f"model {model!r} version {version!r} already exists with different "
                    f"content (differs in {changed}); versions are immutable, push a new "
                    "version instead"
                )
            record = existing
            created = False
        else:
            for path, info in sorted(files.items()):
                if path == CONFIG_FILE:
                    continue
                await self.store.put_file(f"{prefix}/{path}", spool.path(path))
                stored += info.size
            await self.store.write_bytes(f"{prefix}/{CONFIG_FILE}", stored_config)
            stored += len(stored_config)
            created_ms = time.time_ns() // 1_000_000
            sig = None
            if self._signing_key is not None:
                payload = signed_payload(model, version, {p: f.sha256 for p, f in files.items()})
                sig = {
                    "alg": ALGORITHM,
                    "key_id": self._signing_key_id,
                    "value": sign(self._signing_key, payload),
                }
            # Under the model's lock: no other push takes the same number.
            highest = await numbering.highest_number(self.store, f"{ROOT}/{model}")
            number = next_number(version, await self.numbers(model), floor=highest)
            manifest_json = build_manifest(model, version, files, created_ms, sig, number)
            # The manifest goes last: its presence is what makes the version exist.
            await self.store.write_bytes(f"{prefix}/{MANIFEST_FILE}", manifest_json)
            stored += len(manifest_json)
            if number > highest:
                # After the manifest: a crash in between loses nothing, the
                # manifests' numbers count too.
                await numbering.record_highest(self.store, f"{ROOT}/{model}", number)
            record = VersionRecord(
                model=model,
                version=version,
                config=config,
                config_json=stored_config,
                manifest_json=manifest_json,
                digest=hashlib.sha256(manifest_json).hexdigest(),
                files=files,
                created_unix_ms=created_ms,
                signature=sig["value"] if sig else "",
                key_id=sig["key_id"] if sig else "",
                profile_json=(
                    spool.path(PROFILE_FILE).read_bytes() if PROFILE_FILE in files else b""
                ),
                number=number,
            )

        versions = await self.versions(model)
        current = await self.aliases(model)
        new_aliases = dict(current)
        archived = await self._archived(model)
        if version in archived:
            raise FailedPrecondition(
                f"model {model!r} version {version!r} exists and is archived; run "
                f"`inferbus models unarchive {model} {version}` first"
            )
        new_aliases["latest"] = naming.highest_version([v for v in versions if v not in archived])
        for alias in aliases:
            new_aliases[alias] = version
        new_aliases.setdefault("stable", version)
        if new_aliases != current:
            await self._write_aliases(model, new_aliases)
        state = ModelState(
            name=model,
            versions=versions,
            aliases=new_aliases,
            archived=[v for v in versions if v in archived],
            unloaded=await self.store.exists(f"{ROOT}/{model}/{UNLOADED_FILE}"),
        )
        return PushResult(record=record, state=state, created=created, bytes_stored=stored)
