"""The local artifact cache: files of a version fetched from the registry, SHA-256 checked.

Layout: ``<cache_dir>/<model token>/<version token>/<path>`` (tokens from
`inferbus_common.subjects.subject_token`, so any model name is a safe
directory name). A cached file whose digest matches the catalog is used as it
is, so a warm cache serves without the registry; anything else is downloaded
through the registry's ``DownloadFile`` stream into a temporary file, checked,
and only then renamed into place.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path, PurePosixPath

import grpc

from inferbus_common.catalog import DeployedVersion
from inferbus_common.errors import FailedPrecondition, Unavailable
from inferbus_common.subjects import subject_token
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20


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
    """

    def __init__(self, cache_dir: Path, registry_url: str, *, timeout_s: float = 300.0) -> None:
        self.root = cache_dir.expanduser()
        self._registry_url = registry_url
        self._timeout_s = timeout_s

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
            return directory
        await asyncio.to_thread(self._download_all, dv, missing)
        return directory

    def _download_all(self, dv: DeployedVersion, missing: list[tuple[str, str, Path]]) -> None:
        # The blocking gRPC client in a thread, not grpc.aio: grpc.aio ties itself to
        # one event loop per process, and the download's file writes stay off the loop.
        with grpc.insecure_channel(self._registry_url) as channel:
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
