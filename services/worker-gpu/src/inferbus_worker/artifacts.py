"""The local artifact cache: files of a version fetched from the registry, SHA-256 checked.

Layout: ``<cache_dir>/<model token>/<version token>/<path>`` (tokens from
`inferbus_common.subjects.subject_token`, so any model name is a safe
directory name). A cached file whose digest matches the catalog is used as it
is, so a warm cache serves without the registry; anything else is downloaded
through the registry's ``DownloadFile`` stream into a temporary file, checked,
and only then renamed into place.

The cache can be bounded in bytes (``max_bytes``): after every fetch, versions
that are not in use (``in_use()``: loaded or loading) are removed, least
recently used first, until the cache fits. A version in use is never removed,
even when it alone exceeds the bound (a warning says so). Each cached version
holds a ``.cached`` marker whose mtime is its last use, so the order survives
a restart; folders without it (e.g. the TensorRT engine cache) are not touched.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import grpc

from inferbus_common import grpcauth
from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import FailedPrecondition, Unavailable
from inferbus_common.subjects import subject_token
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc
from inferbus_worker import metrics

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20
MARKER = ".cached"
"""File in a cached version's folder: who it is; its mtime is the last use."""


class ArtifactError(Unavailable):
    """A version's files could not be fetched (registry down, missing file)."""


class DigestMismatch(FailedPrecondition):
    """A file's SHA-256 is not the one the catalog lists: it is not loaded."""


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _safe_relative(path: str) -> PurePosixPath:
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ArtifactError(f"refusing artifact path {path!r} (absolute or outside the version)")
    return rel


class ArtifactCache:
    """Fetches and verifies the files of deployed versions.

    Args:
        cache_dir: root of the cache.
        registry_url: ``host:port`` of the registry's gRPC server.
        timeout_s: limit for downloading one file.
        max_bytes: bound of the cache (0 = unbounded).
        in_use: the (model, version) pairs that must never be evicted.
    """

    def __init__(
        self,
        cache_dir: Path,
        registry_url: str,
        *,
        timeout_s: float = 300.0,
        max_bytes: int = 0,
        in_use: Callable[[], set[tuple[str, str]]] | None = None,
        registry_token: str | None = None,
    ) -> None:
        self.root = cache_dir.expanduser()
        self._registry_url = registry_url
        self._registry_token = registry_token
        self._timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._in_use = in_use or set

    def version_dir(self, model: str, version: str) -> Path:
        """Directory of one version's files."""
        return self.root / subject_token(model) / subject_token(version)

    async def fetch(self, dv: DeployedVersion) -> Path:
        """Make every file of `dv` present and verified; return the version directory.

        Raises:
            ArtifactError: the model file is not in the version's file list, or
                the registry cannot deliver a file.
            DigestMismatch: a downloaded file does not have the listed SHA-256.
        """
        if dv.config.file not in dv.files:
            # Only files with a known digest are ever loaded.
            raise ArtifactError(
                f"{dv.model}/{dv.version}: model file {dv.config.file!r} "
                "has no digest in the catalog"
            )
        directory = self.version_dir(dv.model, dv.version)
        missing = []
        for path, sha in sorted(dv.files.items()):
            target = directory / _safe_relative(path)
            if target.is_file() and await asyncio.to_thread(file_sha256, target) == sha:
                continue
            missing.append((path, sha, target))
        if not missing:
            log.info(
                "artifacts of %s/%s are cached",
                dv.model,
                dv.version,
                extra={"model": dv.model, "version": dv.version},
            )
        else:
            await asyncio.to_thread(self._download_all, dv, missing)
        await asyncio.to_thread(self._touch, dv, directory)
        # The in-use set is read here, on the event loop that changes it.
        keep = set(self._in_use()) | {(dv.model, dv.version)}
        await asyncio.to_thread(self.evict, keep)
        return directory

    # --- size bound -------------------------------------------------------------
    def mark_used(self, model: str, version: str) -> None:
        """Record a use of a cached version now (e.g. when it stops serving)."""
        marker = self.version_dir(model, version) / MARKER
        if marker.is_file():
            os.utime(marker)

    def _touch(self, dv: DeployedVersion, directory: Path) -> None:
        marker = directory / MARKER
        marker.write_text(json.dumps({"model": dv.model, "version": dv.version}))
        os.utime(marker)

    def entries(self) -> list[tuple[float, int, Path, tuple[str, str]]]:
        """Cached versions as (last use, bytes, folder, (model, version)), oldest first."""
        out = []
        for marker in self.root.glob(f"*/*/{MARKER}"):
            folder = marker.parent
            try:
                who = json.loads(marker.read_text())
                key = (str(who["model"]), str(who["version"]))
                used = marker.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                continue
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            out.append((used, size, folder, key))
        return sorted(out, key=lambda e: e[0])

    def evict(self, keep: set[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
        """Remove least recently used versions not in use until the cache fits.

        Args:
            keep: versions that must stay (None = `in_use()`); blocking, so a
                caller off the event loop passes the set it read on the loop.

        Returns:
            The (model, version) pairs removed.
        """
        entries = self.entries()
        total = sum(e[1] for e in entries)
        removed: list[tuple[str, str]] = []
        if self.max_bytes > 0 and total > self.max_bytes:
            protected = set(keep) if keep is not None else set(self._in_use())
            for _used, size, folder, key in entries:
                if total <= self.max_bytes:
                    break
                if key in protected:
                    continue
                shutil.rmtree(folder, ignore_errors=True)
                total -= size
                removed.append(key)
                metrics.CACHE_EVICTIONS.inc()
                log.info(
                    "evicted from the artifact cache (%d bytes)",
                    size,
                    extra={"model": key[0], "version": key[1]},
                )
            if total > self.max_bytes:
                log.warning(
                    "artifact cache holds %d bytes, over its bound of %d: the rest is in use",
                    total,
                    self.max_bytes,
                )
        metrics.CACHE_BYTES.set(total)
        return removed

    def _download_all(self, dv: DeployedVersion, missing: list[tuple[str, str, Path]]) -> None:
        # The blocking gRPC client in a thread, not grpc.aio: grpc.aio ties itself to
        # one event loop per process, and the download's file writes stay off the loop.
        with grpcauth.channel(self._registry_url, self._registry_token) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            for path, sha, target in missing:
                self._download(stub, dv, path, sha, target)

    def _download(
        self,
        stub: registry_pb2_grpc.RegistryStub,
        dv: DeployedVersion,
        path: str,
        sha: str,
        target: Path,
    ) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        digest = hashlib.sha256()
        size = 0
        request = registry_pb2.DownloadFileRequest(model=dv.model, version=dv.version, path=path)
        try:
            with tmp.open("wb") as f:
                for chunk in stub.DownloadFile(request, timeout=self._timeout_s):
                    digest.update(chunk.data)
                    f.write(chunk.data)
                    size += len(chunk.data)
            if digest.hexdigest() != sha:
                raise DigestMismatch(
                    f"{dv.model}/{dv.version}/{path}: SHA-256 {digest.hexdigest()} "
                    f"is not the catalog's {sha}"
                )
            tmp.replace(target)
        except grpc.RpcError as exc:
            raise ArtifactError(
                f"registry could not deliver {dv.model}/{dv.version}/{path}: "
                f"{exc.code().name} {exc.details()}"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        log.info(
            "downloaded %s (%d bytes)",
            path,
            size,
            extra={"model": dv.model, "version": dv.version},
        )
