"""The two stores behave the same: local directory and real S3 (SeaweedFS, signed)."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inferbus_common.errors import NotFound, Unavailable
from inferbus_registry.store import LocalStore, S3Store, Store
from inferbus_testing.servers import S3Server


class _Boom(RuntimeError):
    pass


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _failing(first: bytes) -> AsyncIterator[bytes]:
    yield first
    raise _Boom("client went away")


@pytest.fixture(params=["local", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "repo")
    s3: S3Server = request.getfixturevalue("s3_server")
    bucket = "ib-" + secrets.token_hex(6)
    st = S3Store(s3.endpoint, s3.access_key, s3.secret_key, bucket)
    await st.check()
    return st


async def test_put_get_list_exists_delete(store: Store) -> None:
    assert await store.put("models/a/1/model.onnx", _chunks(b"abc", b"def")) == 6
    await store.write_bytes("models/a/aliases.json", b'{"aliases": {"stable": "1"}}')
    assert b"".join([c async for c in store.get("models/a/1/model.onnx")]) == b"abcdef"
    assert await store.read_json("models/a/aliases.json") == {"aliases": {"stable": "1"}}
    assert await store.list("models/") == ["models/a/1/model.onnx", "models/a/aliases.json"]
    assert await store.list("models/b/") == []
    assert await store.exists("models/a/1/model.onnx")
    assert not await store.exists("models/a/2/model.onnx")
    await store.delete("models/a/1/model.onnx")
    await store.delete("models/a/1/model.onnx")  # deleting twice is fine
    assert not await store.exists("models/a/1/model.onnx")


async def test_missing_files_are_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.read_bytes("models/none/1/config.json")
    with pytest.raises(NotFound):
        async for _ in store.get("models/none/1/model.onnx"):
            pass


async def test_large_file_streams_in_bounded_chunks(store: Store, tmp_path: Path) -> None:
    # 20 MiB: more than one S3 multipart part and many 1 MiB chunks.
    src = tmp_path / "big.bin"
    block = os.urandom(1 << 20)
    with src.open("wb") as fh:
        for i in range(20):
            fh.write(bytes([i]) + block[1:])
    assert await store.put_file("models/big/1/model.onnx", src) == 20 << 20
    digest = hashlib.sha256()
    sizes = []
    async for chunk in store.get("models/big/1/model.onnx", 1 << 20):
        digest.update(chunk)
        sizes.append(len(chunk))
    assert max(sizes) <= 1 << 20
    assert digest.hexdigest() == hashlib.sha256(src.read_bytes()).hexdigest()


async def test_streamed_put_larger_than_a_part(store: Store) -> None:
    parts = [bytes([i]) * (3 << 20) for i in range(7)]  # 21 MiB in 3 MiB chunks
    assert await store.put("models/s/1/model.onnx", _chunks(*parts)) == 21 << 20
    got = hashlib.sha256()
    async for chunk in store.get("models/s/1/model.onnx"):
        got.update(chunk)
    assert got.hexdigest() == hashlib.sha256(b"".join(parts)).hexdigest()


async def test_failed_upload_leaves_old_file_untouched(store: Store) -> None:
    await store.write_bytes("models/a/1/model.onnx", b"old")
    with pytest.raises(_Boom):
        await store.put("models/a/1/model.onnx", _failing(b"new partial"))
    assert await store.read_bytes("models/a/1/model.onnx") == b"old"
    assert await store.list("models/a/") == ["models/a/1/model.onnx"]


@pytest.mark.parametrize("key", ["../escape", "/abs", "models/../x", "models//x", ""])
async def test_keys_cannot_escape_the_root(store: Store, key: str) -> None:
    with pytest.raises(ValueError, match="invalid store key"):
        await store.write_bytes(key, b"x")


async def test_s3_checks_signatures(s3_server: S3Server) -> None:
    st = S3Store(s3_server.endpoint, s3_server.access_key, "wrong-secret", "ib-sig")
    with pytest.raises(Unavailable, match="S3"):
        await st.check()


async def test_local_store_writes_atomically(tmp_path: Path) -> None:
    st = LocalStore(tmp_path / "repo")
    with pytest.raises(_Boom):
        await st.put("models/a/1/model.onnx", _failing(b"partial"))
    # Neither the final file nor a leftover temporary file.
    assert not any((tmp_path / "repo").rglob("*.onnx*"))
