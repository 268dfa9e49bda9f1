"""What a push sends and a download writes, for every registry client: the files of
a version directory, the PushVersion message stream, and a file written only
once its SHA-256 and size match the manifest.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from pydantic import ValidationError

from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig
from inferbus_proto.registry import registry_pb2

CHUNK_BYTES = 1 << 20
"""Size of one file chunk in PushVersion (1 MiB)."""
#: Files of a version directory the registry writes itself, never uploaded.
NOT_UPLOADED = frozenset({"config.json", "manifest.json"})
#: A scikit-learn/LightGBM pickle the registry converts to ONNX at push (never stored).
PICKLE_NAMES = ("model.pkl", "model.joblib")
#: A torch.export program: its config can be derived from its signature (not a .pt's).
EXPORTED_NAME = "model.pt2"


class PushError(InvalidArgument):
    """The files to push are not usable (said before anything is sent)."""


def collect_files(
    path: Path, config: Path | None, *, validate: bool = True, derive: bool = False
) -> tuple[bytes, list[tuple[str, Path]]]:
    """The config bytes and ``(path in version, local file)`` pairs to upload.

    `path` is a version directory (``config.json`` plus the artifact files, any
    depth; hidden files are skipped) or a single model file pushed with a
    separate `config` (default: a ``config.json`` beside it); a single file is
    stored under the config's ``file`` name (``model.onnx`` by default). With
    `derive` (the CLI's ``models push model.onnx`` without ``--config``), a
    single ``.onnx`` file without `config` is pushed as ``model.onnx`` with
    empty config bytes: the registry derives the config from the graph
    (Triton's auto-complete); so is one with no ``config.json`` beside it.
    A pickled scikit-learn model (a ``.pkl`` or ``.joblib`` file, or a directory
    holding ``model.pkl``/``model.joblib`` and no ``config.json``) goes the same
    way: the registry converts it to ``model.onnx`` and derives the config. A
    torch.export program (a ``.pt2`` file, or a directory holding ``model.pt2``
    and no ``config.json``) too: the registry reads the config from its signature.

    With `validate` off a config that does not parse is sent as it is (the
    registry refuses it with its own message).

    Raises:
        PushError: a file is missing, the config is invalid, or the artifact the
            config names is not among the files.
    """
    if path.is_dir():
        config_path = config or path / "config.json"
        if (
            config is None
            and not config_path.is_file()
            and any((path / name).is_file() for name in (*PICKLE_NAMES, EXPORTED_NAME))
        ):
            return b"", _directory_files(path)
        if not config_path.is_file():
            raise PushError(f"{config_path} not found (a version directory needs config.json)")
        files = _directory_files(path)
    elif path.is_file():
        config_path = config or path.parent / "config.json"
        if config is None and path.suffix == ".onnx" and (derive or not config_path.is_file()):
            return b"", [("model.onnx", path)]
        if config is None and path.suffix == ".pt2" and (derive or not config_path.is_file()):
            return b"", [(EXPORTED_NAME, path)]
        if config is None and path.suffix in (".pkl", ".joblib"):
            return b"", [("model" + path.suffix, path)]
        if config is None and not config_path.is_file():
            raise PushError(f"{path} is a single file: give its config with --config config.json")
        if not config_path.is_file():
            raise PushError(f"{config_path} not found")
        files = []
    else:
        raise PushError(f"{path} does not exist")
    config_bytes = config_path.read_bytes()
    try:
        parsed = ModelConfig.model_validate_json(config_bytes)
    except ValidationError as exc:
        if validate:
            raise PushError(f"{config_path} is not a valid model config:\n{exc}") from exc
        # The registry checks it and says what is wrong.
        return config_bytes, files if path.is_dir() else [(path.name, path)]
    if path.is_file():
        files = [(parsed.file, path)]
    names = {name for name, _ in files}
    if (
        validate
        and parsed.file not in names
        and not any(n.startswith(parsed.file + "/") for n in names)
    ):
        raise PushError(f"the config names artifact {parsed.file!r} but {path} does not hold it")
    return config_bytes, files


def _directory_files(path: Path) -> list[tuple[str, Path]]:
    return sorted(
        (p.relative_to(path).as_posix(), p)
        for p in path.rglob("*")
        if p.is_file()
        and p.relative_to(path).as_posix() not in NOT_UPLOADED
        # Hidden files (.gitignore, editor swap files) are not part of a model.
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def push_messages(
    model: str,
    version: str,
    config_bytes: bytes,
    aliases: list[str],
    files: list[tuple[str, Path]],
    on_chunk: Callable[[int], None] | None = None,
) -> Iterator[registry_pb2.PushChunk]:
    """The PushVersion stream: the header, then every file in 1 MiB chunks.

    `on_chunk` is called with each chunk's size as gRPC takes it (the
    progress bar), so it counts what was handed to the channel.
    """
    yield registry_pb2.PushChunk(
        header=registry_pb2.PushHeader(
            model=model, version=version, config_json=config_bytes, aliases=aliases
        )
    )
    for name, local in files:
        with open(local, "rb") as f:
            sent = False
            while chunk := f.read(CHUNK_BYTES):
                yield registry_pb2.PushChunk(chunk=registry_pb2.FileChunk(path=name, data=chunk))
                if on_chunk is not None:
                    on_chunk(len(chunk))
                sent = True
            if not sent:
                # An empty file still has to exist in the version.
                yield registry_pb2.PushChunk(chunk=registry_pb2.FileChunk(path=name, data=b""))


class DigestMismatch(ValueError):
    """The bytes received do not match the manifest's SHA-256 or size."""


class VerifiedFile:
    """A download written to a temporary file beside `dest`, renamed into place only
    when complete and matching the manifest (`dest` never holds a partial file).

    Use as ``with VerifiedFile(dest, sha256, size) as out: out.write(...)``;
    leaving the block without an error checks and renames.

    Args:
        dest: where the file ends up.
        sha256: the manifest's digest.
        size: the manifest's size (None: not checked).
        label: how messages name the file.
    """

    def __init__(self, dest: Path, sha256: str, size: int | None = None, label: str = "") -> None:
        self.dest = dest
        self._sha256 = sha256
        self._size = size
        self._label = label or dest.name
        self._digest = hashlib.sha256()
        self.received = 0
        self._tmp: Path | None = None
        self._fh: BinaryIO | None = None

    def __enter__(self) -> VerifiedFile:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.dest.name}.", suffix=".part", dir=self.dest.parent
        )
        self._tmp = Path(tmp)
        self._fh = os.fdopen(fd, "wb")
        return self

    def write(self, data: bytes) -> None:
        """Append one chunk."""
        assert self._fh is not None, "write inside `with VerifiedFile(...)`"
        self._fh.write(data)
        self._digest.update(data)
        self.received += len(data)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tmp is not None and self._fh is not None
        self._fh.close()
        try:
            if exc_type is None:
                got = self._digest.hexdigest()
                if got != self._sha256 or (self._size is not None and self.received != self._size):
                    want = f"{self._size} bytes with " if self._size is not None else ""
                    raise DigestMismatch(
                        f"{self._label}: received {self.received} bytes with SHA-256 {got}, "
                        f"the manifest lists {want}{self._sha256}; try again"
                    )
                os.replace(self._tmp, self.dest)
        finally:
            self._tmp.unlink(missing_ok=True)
