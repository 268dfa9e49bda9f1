"""Pushing a version: spool the files, check them, store them, move the aliases.

A version exists once its `manifest.json` exists: it is written last, so an
interrupted push leaves files without a manifest, which a later push of the
same version simply overwrites. Versions are immutable after that.

Part of `ModelRepository` (`inferbus_registry.repository`).
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from inferbus_common.engineconfig import TORCH_FILES
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound
from inferbus_common.imageformat import complete_formats
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.signing import ALGORITHM, sign, signed_payload
from inferbus_common.versionnumbers import next_number
from inferbus_registry import naming, numbering
from inferbus_registry.layout import (
    CONFIG_FILE,
    MANIFEST_FILE,
    ROOT,
    UNLOADED_FILE,
    build_manifest,
    canonical_config_json,
    parse_config,
    version_prefix,
)
from inferbus_registry.onnxcheck import check_onnx, derive_config
from inferbus_registry.processingcheck import (
    check_label_files,
    check_processing,
    with_python_file,
)
from inferbus_registry.profilecheck import PROFILE_FILE, check_profile
from inferbus_registry.records import FileInfo, ModelState, PushResult, VersionRecord
from inferbus_registry.sklearnconvert import (
    CONVERSION_FILE,
    CONVERTED_FILE,
    PICKLE_FILES,
    SAMPLE_FILE,
    Conversion,
    ConversionLimits,
    convert_pickle,
    file_info,
    pickle_source,
)
from inferbus_registry.store import Store
from inferbus_registry.torchcheck import check_torch_file, derive_torch_config


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


class VersionPush:
    """The push of `ModelRepository` (its base class)."""

    store: Store
    _signing_key: Ed25519PrivateKey | None
    _signing_key_id: str
    _spool_dir: Path | None
    _max_push: int
    _conversion: ConversionLimits
    _conversion_slots: asyncio.Semaphore

    if TYPE_CHECKING:

        def _lock(self, model: str) -> asyncio.Lock: ...

        async def versions(self, model: str) -> list[str]: ...

        async def aliases(self, model: str) -> dict[str, str]: ...

        async def numbers(self, model: str) -> dict[str, int]: ...

        async def get_version(self, model: str, version_or_alias: str = "") -> VersionRecord: ...

        async def _archived(self, model: str) -> set[str]: ...

        async def _write_aliases(self, model: str, aliases: dict[str, str]) -> None: ...

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
            conversion = None
            source = pickle_source(files, model)
            if source is not None:
                # A scikit-learn/LightGBM pickle: converted in a sandboxed child;
                # model.onnx replaces it (and the sample), nothing pickled is stored.
                if config is not None and config.file not in (source, CONVERTED_FILE):
                    raise InvalidArgument(
                        f"{model}: config.json names file {config.file!r}; with {source} "
                        f"it names {source} or {CONVERTED_FILE} (what the registry serves)"
                    )
                async with self._conversion_slots:
                    conversion = await convert_pickle(
                        tmp,
                        source,
                        files[source].sha256,
                        model,
                        self._conversion,
                        with_sample=SAMPLE_FILE in files,
                    )
                for name in (source, SAMPLE_FILE):
                    if files.pop(name, None) is not None:
                        await asyncio.to_thread(spool.path(name).unlink)
                files[CONVERTED_FILE] = await asyncio.to_thread(
                    file_info, spool.path(CONVERTED_FILE)
                )
                record_json = conversion.record_json()
                await asyncio.to_thread(spool.path(CONVERSION_FILE).write_bytes, record_json)
                files[CONVERSION_FILE] = FileInfo(
                    sha256=hashlib.sha256(record_json).hexdigest(), size=len(record_json)
                )
                if config is not None:
                    config = config.model_copy(update={"file": CONVERTED_FILE})
            torch_files = [f for f in files if f.endswith(TORCH_FILES)]
            if config is None and not any(f.endswith(".onnx") for f in files) and torch_files:
                if len(torch_files) != 1:
                    raise InvalidArgument(
                        f"{model}: config.json is missing and the push sends several PyTorch "
                        f"programs {sorted(torch_files)}: push a config.json naming one"
                    )
                config = await asyncio.to_thread(
                    derive_torch_config, spool.path(torch_files[0]), model
                )
            if config is None:
                onnx_files = [f for f in files if f.endswith(".onnx")]
                if len(onnx_files) != 1:
                    raise InvalidArgument(
                        f"{model}: config.json is missing from the push and there is no single "
                        f".onnx file to derive it from (sent: {sorted(files)}; a scikit-learn "
                        f"pickle is converted when named {' or '.join(PICKLE_FILES)})"
                    )
                config = await asyncio.to_thread(derive_config, spool.path(onnx_files[0]), model)
            # Triton's auto-complete of image layouts the shape makes clear.
            config = complete_formats(config)
            # A pushed preprocessor.py turns on Python processing (issue 27).
            config = with_python_file(config, files)
            stored_config = canonical_config_json(config)
            if config.file not in files:
                raise InvalidArgument(
                    f"{model}: config.json names file {config.file!r} but the push sent "
                    f"{sorted(files) or 'no files'}"
                )
            if config.platform == "onnxruntime_onnx" or config.file.endswith(".onnx"):
                # With processing the graph takes and gives the engine-facing tensors.
                await asyncio.to_thread(check_onnx, spool.path(config.file), config.engine_view())
            elif config.engine.kind == "pytorch":
                # Read from the archive's own JSON: the registry has no torch.
                await asyncio.to_thread(check_torch_file, spool.path(config.file), config, model)
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
                    model, version, config, stored_config, files, spool, aliases, conversion
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
        conversion: Conversion | None = None,
    ) -> PushResult:
        prefix = version_prefix(model, version)
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
            manifest_json = build_manifest(
                model,
                version,
                files,
                created_ms,
                sig,
                number,
                conversion=(
                    None
                    if conversion is None
                    else {**conversion.record, "timings_s": conversion.timings_s}
                ),
            )
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
