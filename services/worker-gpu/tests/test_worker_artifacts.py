"""The artifact cache: downloads over gRPC ``DownloadFile``, SHA-256 checks, warm cache.

The registry here is a real gRPC server on a port it picks, serving files from
a directory through the registry's generated servicer base class; it stands in
for the registry service, which is tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from inferbus_common.catalog import DeployedVersion
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc
from inferbus_worker.artifacts import ArtifactCache, ArtifactError, DigestMismatch


class DirectoryRegistry(registry_pb2_grpc.RegistryServicer):
    """Serves ``<root>/<model>/<version>/<path>`` in small chunks and counts downloads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.downloads: list[str] = []

    def DownloadFile(
        self, request: registry_pb2.DownloadFileRequest, context: grpc.ServicerContext
    ) -> Iterator[registry_pb2.FileChunk]:
        path = self.root / request.model / request.version / request.path
        if not path.is_file():
            context.abort(grpc.StatusCode.NOT_FOUND, f"no file {request.path}")
        self.downloads.append(request.path)
        data = path.read_bytes()
        for i in range(0, len(data), 4096):
            yield registry_pb2.FileChunk(path=request.path, data=data[i : i + 4096])


@pytest.fixture
def registry(tmp_path: Path, fraud_dir: Path) -> Iterator[tuple[str, DirectoryRegistry]]:
    root = tmp_path / "store"
    (root / "fraud" / "1").mkdir(parents=True)
    for name in ("model.onnx", "config.json"):
        (root / "fraud" / "1" / name).write_bytes((fraud_dir / name).read_bytes())
    servicer = DirectoryRegistry(root)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None).wait()


async def test_download_verify_then_serve_from_cache(
    tmp_path: Path, registry: tuple[str, DirectoryRegistry], fraud_deployed: DeployedVersion
) -> None:
    url, servicer = registry
    cache = ArtifactCache(tmp_path / "cache", url)
    directory = await cache.fetch(fraud_deployed)
    assert sorted(servicer.downloads) == ["config.json", "model.onnx"]
    assert (directory / "model.onnx").stat().st_size > 0
    assert not list(directory.glob(".*.part"))
    # A warm cache does not ask the registry again.
    assert await cache.fetch(fraud_deployed) == directory
    assert len(servicer.downloads) == 2
    # A file changed on disk is fetched again.
    (directory / "config.json").write_text("{}")
    await cache.fetch(fraud_deployed)
    assert servicer.downloads[-1] == "config.json"


async def test_wrong_digest_is_refused(
    tmp_path: Path, registry: tuple[str, DirectoryRegistry], fraud_deployed: DeployedVersion
) -> None:
    url, _ = registry
    files = dict(fraud_deployed.files, **{"model.onnx": "0" * 64})
    dv = fraud_deployed.model_copy(update={"files": files})
    cache = ArtifactCache(tmp_path / "cache", url)
    with pytest.raises(DigestMismatch, match=r"model\.onnx"):
        await cache.fetch(dv)
    assert not (cache.version_dir("fraud", "1") / "model.onnx").exists()


async def test_missing_file_and_unlisted_model_are_errors(
    tmp_path: Path, registry: tuple[str, DirectoryRegistry], fraud_deployed: DeployedVersion
) -> None:
    url, _ = registry
    cache = ArtifactCache(tmp_path / "cache", url)
    extra = fraud_deployed.model_copy(
        update={"files": dict(fraud_deployed.files, **{"extra.bin": "0" * 64})}
    )
    with pytest.raises(ArtifactError, match="NOT_FOUND"):
        await cache.fetch(extra)
    unlisted = fraud_deployed.model_copy(update={"files": {"config.json": "0" * 64}})
    with pytest.raises(ArtifactError, match="has no digest"):
        await cache.fetch(unlisted)
    escaping = fraud_deployed.model_copy(
        update={"files": dict(fraud_deployed.files, **{"../evil": "0" * 64})}
    )
    with pytest.raises(ArtifactError, match="outside the version"):
        await cache.fetch(escaping)
