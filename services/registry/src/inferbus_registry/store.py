"""Where artifacts live: a `Store` protocol with a local-directory and an S3 form.

Keys are ``/``-separated relative paths such as
``models/fraud/1.2.0/model.onnx``; callers validate them (see `naming`), the
stores only refuse keys that could escape their root. Files move as streams of
chunks so that a multi-gigabyte artifact never sits in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

from minio import Minio
from minio.error import S3Error

from inferbus_common.errors import NotFound, Unavailable

CHUNK_SIZE = 1 << 20
"""Size of the chunks `Store.get` yields (1 MiB)."""

_S3_PART_SIZE = 16 << 20
"""Multipart part size for uploads of unknown length (S3 needs at least 5 MiB)."""


def _check_key(key: str) -> None:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}")


class Store(Protocol):
    """An object store holding the model repository.

    Every method is a coroutine (or an async iterator) so the event loop never
    blocks on disk or network I/O.
    """

    async def check(self) -> None:
        """Raise `Unavailable` when the store cannot be reached."""
        ...

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        """Store a file from a stream of chunks, replacing any old one.

        Readers never see half a file: the new content appears at once.

        Returns:
            The number of bytes written.
        """
        ...

    async def put_file(self, key: str, path: Path) -> int:
        """Store a local file; returns the number of bytes written."""
        ...

    def get(self, key: str, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
        """Stream a file as chunks of at most `chunk_size` bytes.

        Raises:
            NotFound: when the key does not exist (raised on first iteration).
        """
        ...

    async def list(self, prefix: str) -> list[str]:
        """Every key under `prefix` (recursively), sorted."""
        ...

    async def exists(self, key: str) -> bool:
        """Whether `key` holds a file."""
        ...

    async def delete(self, key: str) -> None:
        """Remove a file; a missing one is not an error."""
        ...

    async def read_json(self, key: str) -> Any:
        """Read and parse a small JSON file.

        Raises:
            NotFound: when the key does not exist.
        """
        ...

    async def read_bytes(self, key: str) -> bytes:
        """Read a small file whole.

        Raises:
            NotFound: when the key does not exist.
        """
        ...

    async def write_bytes(self, key: str, data: bytes) -> None:
        """Write a small file whole (atomically replacing any old one)."""
        ...


async def _single(data: bytes) -> AsyncIterator[bytes]:
    yield data


class LocalStore:
    """A `Store` in a local directory.

    Writes go to a temporary file in the destination directory, are flushed to
    disk and then renamed over the final name, so a crash leaves either the old
    file or the new one, never half of one.

    Args:
        root: directory of the repository (created when missing).
    """

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser()

    def _path(self, key: str) -> Path:
        _check_key(key)
        return self.root / key

    async def check(self) -> None:
        """Create the root if needed and make sure it is a writable directory."""

        def _check() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK):
                raise Unavailable(f"store directory {self.root} is not writable")

        try:
            await asyncio.to_thread(_check)
        except OSError as exc:
            raise Unavailable(f"store directory {self.root}: {exc}") from exc

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        """See `Store.put`."""
        dest = self._path(key)
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        fd, tmp_name = await asyncio.to_thread(
            tempfile.mkstemp, prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent
        )
        tmp = Path(tmp_name)
        size = 0
        try:
            with os.fdopen(fd, "wb") as fh:
                async for chunk in chunks:
                    await asyncio.to_thread(fh.write, chunk)
                    size += len(chunk)
                await asyncio.to_thread(_flush_and_sync, fh)
            await asyncio.to_thread(os.replace, tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    async def put_file(self, key: str, path: Path) -> int:
        """See `Store.put_file`."""
        return await self.put(key, _read_file_chunks(path))

    async def get(self, key: str, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
        """See `Store.get`."""
        path = self._path(key)
        try:
            fh = await asyncio.to_thread(path.open, "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"no file {key}") from exc
        with fh:
            while chunk := await asyncio.to_thread(fh.read, chunk_size):
                yield chunk

    async def list(self, prefix: str) -> list[str]:
        """See `Store.list`."""

        def _walk() -> list[str]:
            base = self.root / prefix if prefix else self.root
            if not base.is_dir():
                return []
            out = []
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    if name.startswith(".") and name.endswith(".tmp"):
                        continue  # an unfinished write
                    out.append(Path(dirpath, name).relative_to(self.root).as_posix())
            return sorted(out)

        if prefix:
            _check_key(prefix.rstrip("/"))
        return await asyncio.to_thread(_walk)

    async def exists(self, key: str) -> bool:
        """See `Store.exists`."""
        return await asyncio.to_thread(self._path(key).is_file)

    async def delete(self, key: str) -> None:
        """See `Store.delete`; folders left empty are removed too (as in S3, where none exist)."""

        def _delete() -> None:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            parent = path.parent
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()  # only when empty
                except OSError:
                    break
                parent = parent.parent

        await asyncio.to_thread(_delete)

    async def read_bytes(self, key: str) -> bytes:
        """See `Store.read_bytes`."""
        try:
            return await asyncio.to_thread(self._path(key).read_bytes)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"no file {key}") from exc

    async def read_json(self, key: str) -> Any:
        """See `Store.read_json`."""
        return json.loads(await self.read_bytes(key))

    async def write_bytes(self, key: str, data: bytes) -> None:
        """See `Store.write_bytes`."""
        await self.put(key, _single(data))


def _flush_and_sync(fh: Any) -> None:
    fh.flush()
    os.fsync(fh.fileno())


async def _read_file_chunks(path: Path, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
    with await asyncio.to_thread(path.open, "rb") as fh:
        while chunk := await asyncio.to_thread(fh.read, chunk_size):
            yield chunk


class _AsyncChunkReader:
    """A blocking file-like `read(n)` over an async iterator of chunks.

    minio's `put_object` runs in a worker thread and pulls data through
    `read`; each pull asks the event loop for the next chunk, so at most one
    chunk plus one multipart part is in memory at a time.
    """

    def __init__(self, chunks: AsyncIterable[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._it = aiter(chunks)
        self._loop = loop
        self._buf = bytearray()
        self._eof = False
        self.size = 0

    def _next(self) -> bytes | None:
        async def _anext() -> bytes | None:
            try:
                return await anext(self._it)
            except StopAsyncIteration:
                return None

        return asyncio.run_coroutine_threadsafe(_anext(), self._loop).result()

    def read(self, n: int = -1) -> bytes:
        """Return up to `n` bytes (all remaining when `n` < 0); b"" at the end."""
        while not self._eof and (n < 0 or len(self._buf) < n):
            chunk = self._next()
            if chunk is None:
                self._eof = True
            else:
                self._buf += chunk
                self.size += len(chunk)
        if n < 0:
            n = len(self._buf)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchObject", "NoSuchBucket", "ResourceNotFound"})


class S3Store:
    """A `Store` in an S3 bucket (MinIO, SeaweedFS, AWS), through the `minio` SDK.

    The SDK is blocking, so every call runs in a worker thread. Uploads stream
    (multipart for unknown lengths); an S3 object only becomes visible when its
    upload completes, which gives the same all-or-nothing property as the
    local store's rename.

    Args:
        endpoint: ``host:port`` of the S3 server.
        access_key: access key id.
        secret_key: secret access key.
        bucket: bucket holding the repository (created when missing).
        secure: use HTTPS.
        region: region name used for request signing.
    """

    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        *,
        secure: bool = False,
        region: str = "us-east-1",
    ) -> None:
        self.bucket = bucket
        self._client = Minio(
            endpoint,
            access_key=access_key or None,
            secret_key=secret_key or None,
            secure=secure,
            region=region,
        )
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()

    def _ensure_bucket(self) -> None:
        with self._bucket_lock:
            if self._bucket_ready:
                return
            if not self._client.bucket_exists(self.bucket):
                try:
                    self._client.make_bucket(self.bucket)
                except S3Error as exc:
                    # Another registry replica created it first.
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
            self._bucket_ready = True

    async def check(self) -> None:
        """Reach the server and create the bucket when missing."""
        try:
            await asyncio.to_thread(self._ensure_bucket)
        except (S3Error, OSError) as exc:
            raise Unavailable(f"S3 bucket {self.bucket}: {exc}") from exc
        except Exception as exc:  # urllib3 raises its own MaxRetryError etc.
            raise Unavailable(f"S3 endpoint unreachable: {type(exc).__name__}: {exc}") from exc

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        """See `Store.put`."""
        _check_key(key)
        await asyncio.to_thread(self._ensure_bucket)
        reader = _AsyncChunkReader(chunks, asyncio.get_running_loop())
        await asyncio.to_thread(
            self._client.put_object,
            self.bucket,
            key,
            reader,  # type: ignore[arg-type]  # minio wants BinaryIO; it calls only read()
            -1,
            part_size=_S3_PART_SIZE,
        )
        return reader.size

    async def put_file(self, key: str, path: Path) -> int:
        """See `Store.put_file`."""
        _check_key(key)
        await asyncio.to_thread(self._ensure_bucket)
        await asyncio.to_thread(self._client.fput_object, self.bucket, key, str(path))
        return (await asyncio.to_thread(path.stat)).st_size

    async def get(self, key: str, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
        """See `Store.get`."""
        _check_key(key)
        try:
            resp = await asyncio.to_thread(self._client.get_object, self.bucket, key)
        except S3Error as exc:
            if exc.code in _MISSING_CODES:
                raise NotFound(f"no file {key}") from exc
            raise
        try:
            stream: Iterator[bytes] = resp.stream(chunk_size)
            while chunk := await asyncio.to_thread(next, stream, b""):
                yield chunk
        finally:
            resp.close()
            resp.release_conn()

    async def list(self, prefix: str) -> list[str]:
        """See `Store.list`."""

        def _list() -> list[str]:
            self._ensure_bucket()
            return sorted(
                obj.object_name
                for obj in self._client.list_objects(self.bucket, prefix=prefix, recursive=True)
                if obj.object_name is not None and not obj.is_dir
            )

        return await asyncio.to_thread(_list)

    async def exists(self, key: str) -> bool:
        """See `Store.exists`."""
        _check_key(key)
        try:
            await asyncio.to_thread(self._client.stat_object, self.bucket, key)
        except S3Error as exc:
            if exc.code in _MISSING_CODES:
                return False
            raise
        return True

    async def delete(self, key: str) -> None:
        """See `Store.delete`."""
        _check_key(key)
        await asyncio.to_thread(self._client.remove_object, self.bucket, key)

    async def read_bytes(self, key: str) -> bytes:
        """See `Store.read_bytes`."""
        return b"".join([chunk async for chunk in self.get(key)])

    async def read_json(self, key: str) -> Any:
        """See `Store.read_json`."""
        return json.loads(await self.read_bytes(key))

    async def write_bytes(self, key: str, data: bytes) -> None:
        """See `Store.write_bytes`."""
        await self.put(key, _single(data))
