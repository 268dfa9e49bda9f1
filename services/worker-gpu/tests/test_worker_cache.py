"""The artifact cache's size bound: LRU eviction of versions not in use, with real files.

A real gRPC registry stand-in serves the files (as in test_worker_artifacts);
every version is the example fraud model under another version number, so
each costs the same bytes on disk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from inferbus_common.catalog import DeployedVersion
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc
from inferbus_worker.artifacts import MARKER, ArtifactCache


class SameFilesRegistry(registry_pb2_grpc.RegistryServicer):
    """Serves the fraud model's files for any (model, version); counts downloads."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.downloads: list[tuple[str, str]] = []

    def DownloadFile(
        self, request: registry_pb2.DownloadFileRequest, context: grpc.ServicerContext
    ) -> Iterator[registry_pb2.FileChunk]:
        self.downloads.append((request.version, request.path))
        yield registry_pb2.FileChunk(
            path=request.path, data=(self.source / request.path).read_bytes()
        )


@pytest.fixture
def registry(fraud_dir: Path) -> Iterator[tuple[str, SameFilesRegistry]]:
    servicer = SameFilesRegistry(fraud_dir)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None).wait()


def _version(dv: DeployedVersion, version: str) -> DeployedVersion:
    return dv.model_copy(update={"version": version})


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_lru_eviction_keeps_versions_in_use(
    tmp_path: Path, registry: tuple[str, SameFilesRegistry], fraud_deployed: DeployedVersion
) -> None:
    url, servicer = registry
    in_use: set[tuple[str, str]] = set()
    probe = ArtifactCache(tmp_path / "probe", url)
    await probe.fetch(fraud_deployed)
    one = sum(e[1] for e in probe.entries())  # bytes of one cached version, marker included
    assert one > 0

    cache = ArtifactCache(tmp_path / "cache", url, max_bytes=2 * one, in_use=lambda: set(in_use))
    evictions0 = _metric("inferbus_worker_cache_evictions_total")
    d1 = await cache.fetch(_version(fraud_deployed, "1"))
    d2 = await cache.fetch(_version(fraud_deployed, "2"))
    in_use.add(("fraud", "1"))  # v1 is loaded: never evicted
    # v1 is the oldest; make the order unambiguous on coarse-mtime file systems.
    old = time.time() - 100
    os.utime(d1 / MARKER, (old, old))
    os.utime(d2 / MARKER, (old + 1, old + 1))

    d3 = await cache.fetch(_version(fraud_deployed, "3"))
    assert d1.is_dir() and d3.is_dir()
    assert not d2.exists()  # least recently used among those not in use
    assert [e[3][1] for e in cache.entries()] == ["1", "3"]
    assert sum(e[1] for e in cache.entries()) <= cache.max_bytes
    assert _metric("inferbus_worker_cache_evictions_total") == evictions0 + 1
    assert _metric("inferbus_worker_cache_bytes") == sum(e[1] for e in cache.entries())

    # Everything in use: nothing is evicted even over the bound.
    in_use |= {("fraud", "3")}
    d4 = await cache.fetch(_version(fraud_deployed, "4"))
    assert d1.is_dir() and d3.is_dir() and d4.is_dir()
    assert sum(e[1] for e in cache.entries()) == 3 * one > cache.max_bytes

    # Once versions stop being used they go, oldest use first.
    in_use.clear()
    os.utime(d3 / MARKER, (old + 2, old + 2))
    os.utime(d4 / MARKER, (old + 3, old + 3))
    cache.mark_used("fraud", "1")  # v1 just stopped serving: its last use is now
    assert cache.evict() == [("fraud", "3")]
    assert [e[3][1] for e in cache.entries()] == ["4", "1"]
    # An evicted version fetched again is downloaded again.
    before = len(servicer.downloads)
    await cache.fetch(_version(fraud_deployed, "2"))
    assert len(servicer.downloads) == before + 2  # model.onnx and config.json again


async def test_unbounded_cache_and_foreign_folders_are_left_alone(
    tmp_path: Path, registry: tuple[str, SameFilesRegistry], fraud_deployed: DeployedVersion
) -> None:
    url, _ = registry
    cache = ArtifactCache(tmp_path / "cache", url, max_bytes=1)
    trt = cache.root / "tensorrt" / "engines"
    trt.mkdir(parents=True)
    (trt / "x.engine").write_bytes(b"e" * 1000)
    directory = await cache.fetch(fraud_deployed)
    # Over the bound, but the only version is the one just fetched: kept.
    assert directory.is_dir() and (trt / "x.engine").is_file()
    unbounded = ArtifactCache(tmp_path / "cache2", url)
    for v in ("1", "2", "3"):
        await unbounded.fetch(_version(fraud_deployed, v))
    assert len(unbounded.entries()) == 3 and unbounded.evict() == []
