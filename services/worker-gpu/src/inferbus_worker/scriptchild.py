"""One sandboxed process running a version's ``preprocessor.py`` (issue 27).

Started by `inferbus_worker.scriptpool` as ``python -m
inferbus_worker.scriptchild SPEC`` (SPEC: JSON with the version directory,
the file and the memory limit). It enters the sandbox
(`inferbus_worker.sandbox`), runs the file as a module, reports which of
``preprocess`` / ``postprocess`` it defines, then answers one call at a time
until its input closes.

Wire: tensors cross in shared memory, two ``memfd`` files the parent makes
and the child inherits (`Shared`: ``in`` for batches, ``out`` for
results; whoever writes grows the file, the other remaps it), each holding
one ``IBT1`` tensor frame (`inferbus_common.protocol.tensors`) at offset 0.
The pipes (the child's stdin and a duplicate of its stdout; ``print`` in
the user's code goes to stderr, the worker's log) carry 17-byte headers
``<c d Q`` (kind, CPU seconds allowed for the call, length) and small
payloads:

* parent → child: ``P`` (preprocess) or ``O`` (postprocess); length: the
  frame's bytes in ``in``;
* child → parent: ``R`` ready (payload JSON: functions, sandbox report),
  ``K`` the result (length: its frame's bytes in ``out``), ``E`` the call
  raised or returned something that is not a dict of arrays (payload one
  line of text; the child carries on).

The child's input arrays are writable views of ``in`` (in-place work costs
no copy); they are overwritten by the next batch, so the code must not keep
them between calls.

A crash (``os._exit``, a signal, SIGXCPU at the CPU limit, the memory limit)
is seen by the parent as the pipe closing.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

HEADER = struct.Struct("<cdQ")
PRE = b"P"
POST = b"O"
READY = b"R"
OK = b"K"
ERROR = b"E"
FUNCTIONS = {PRE: "preprocess", POST: "postprocess"}


class Shared:
    """One ``memfd`` shared by the worker and a child, mapped read-write.

    `ensure` grows the file (by the side about to write), `view` remaps when
    the other side grew it. Old mappings are dropped, not closed: arrays of
    an earlier call may still point into them.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None
        self._size = 0

    def ensure(self, n: int) -> None:
        size = os.fstat(self.fd).st_size
        if size < n:
            os.ftruncate(self.fd, max(n, 2 * size))

    def view(self, n: int) -> memoryview:
        size = os.fstat(self.fd).st_size
        if self._map is None or size != self._size:
            self._map = mmap.mmap(self.fd, size)
            self._size = size
        return memoryview(self._map)[:n]

    def write(self, parts: list[Any]) -> int:
        """Copy `parts` one after the other to offset 0; their total length."""
        total = sum(memoryview(p).nbytes for p in parts)
        self.ensure(total)
        view = self.view(total)
        at = 0
        for part in parts:
            raw = memoryview(part).cast("B")
            view[at : at + raw.nbytes] = raw
            at += raw.nbytes
        return total


def _read_exact(stream: IO[bytes], n: int) -> bytearray | None:
    """`n` bytes (a writable buffer), or None at end of input."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            return None
        got += k
    return buf


def _send(out: IO[bytes], kind: bytes, payload: bytes) -> None:
    out.write(HEADER.pack(kind, 0.0, len(payload)))
    out.write(payload)
    out.flush()


def _one_line(exc: BaseException, user_file: str = "") -> str:
    """``Type: message (file:line)``: the innermost frame in the user's file, else
    the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f.filename == user_file] or frames[-1:]
    where = f" ({Path(mine[-1].filename).name}:{mine[-1].lineno})" if mine else ""
    return " ".join(f"{type(exc).__name__}: {exc}{where}".split())[:1000]


def _load(directory: Path, rel: str) -> dict[str, Callable[..., Any]]:
    path = directory / rel
    module = types.ModuleType(Path(rel).stem)
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    sys.path.insert(0, str(directory))
    code = compile(path.read_bytes(), str(path), "exec")
    exec(code, module.__dict__)
    return {name: fn for name in FUNCTIONS.values() if callable(fn := getattr(module, name, None))}


def _call(fn: Callable[..., Any], frame: memoryview) -> list[Any]:
    import numpy as np

    from inferbus_common.codec import tensor_from_numpy
    from inferbus_common.protocol.tensors import decode_tensors, tensor_frame_parts

    # Writable arrays: views of the shared batch.
    arrays = {t.name: t.as_numpy() for t in decode_tensors(frame)}
    result = fn(arrays)
    if not isinstance(result, dict):
        raise TypeError(f"must return a dict of name -> numpy array, not {type(result).__name__}")
    tensors = []
    for name, value in result.items():
        if not isinstance(name, str):
            raise TypeError(f"returned a key {name!r} that is not a tensor name (str)")
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        tensors.append(tensor_from_numpy(name, arr))
    return tensor_frame_parts(tensors)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    # The protocol keeps the real stdout; the user's prints go to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    from inferbus_worker import sandbox

    report = sandbox.enter(memory_bytes=int(spec["memory_bytes"]))
    import numpy  # noqa: F401  (before the user's code: its import is not the first call's)

    batches, results = Shared(int(spec["in_fd"])), Shared(int(spec["out_fd"]))
    directory = Path(spec["directory"])
    user_file = str(directory / spec["file"])
    try:
        functions = _load(directory, spec["file"])
    except BaseException as exc:
        message = f"loading {spec['file']} failed: {_one_line(exc, user_file)}"
        _send(out, ERROR, message.encode())
        return 1
    ready = {"functions": sorted(functions), "sandbox": report.as_dict(), "pid": os.getpid()}
    _send(out, READY, json.dumps(ready).encode())
    while True:
        head = _read_exact(inp, HEADER.size)
        if head is None:
            return 0
        kind, cpu_s, size = HEADER.unpack(head)
        fn = functions.get(FUNCTIONS.get(kind, ""))
        if fn is None:
            _send(out, ERROR, f"{FUNCTIONS.get(kind, kind)!r} is not defined".encode())
            continue
        sandbox.cpu_limit(cpu_s)
        try:
            parts = _call(fn, batches.view(size))
        except Exception as exc:
            _send(out, ERROR, f"raised {_one_line(exc, user_file)}".encode())
            continue
        total = results.write(parts)
        out.write(HEADER.pack(OK, 0.0, total))
        out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
