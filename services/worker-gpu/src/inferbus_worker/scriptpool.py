"""A version's ``preprocessor.py`` run in a pool of sandboxed processes (issue 27).

`ScriptPool` keeps ``script_pool_size`` child processes
(`inferbus_worker.scriptchild`, sandboxed by `inferbus_worker.sandbox`) per
version. A batch is handed to one idle child as an ``IBT1`` tensor frame in
shared memory (a ``memfd`` per direction, `scriptchild.Shared`; the pipes
carry a 17-byte header) and its result comes back the same way. The whole call, waiting for an
idle child included, must finish by the batch's deadline (its earliest
request deadline; ``script_timeout_s`` when no request has one). A child
that misses it is killed (SIGKILL to its process group), one that dies
(``os._exit``, a signal, the CPU or memory limit) is reaped; either is
replaced in the background and the call raises `ScriptFailure` with one line
naming the version, the function and what happened. The worker answers the
batch's requests ``INTERNAL`` with it (`inferbus_worker.scripthooks`). An
exception in the user's function fails the batch the same way but the child
serves on.

`ScriptProcessing` checks what the functions return against the version's
config: ``preprocess`` must return every engine input (`ModelConfig.
engine_inputs`) with its datatype, dims that fit and the batch's rows;
``postprocess`` every client output. Extra names are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import Counter, Gauge

from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.errors import FailedPrecondition
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.protocol.framing import FrameError, one_line
from inferbus_common.protocol.tensors import decode_tensors, tensor_frame_parts
from inferbus_common.tensorspec import TensorSpec
from inferbus_worker.scriptchild import ERROR, HEADER, OK, POST, PRE, READY, Shared

log = logging.getLogger(__name__)

SCRIPT_FAILURES = Counter(
    "inferbus_worker_script_failures_total",
    "Batches whose preprocessor.py call failed, by stage and reason "
    "(timeout, crash, exception, invalid: a result that does not fit the config).",
    ["model", "version", "stage", "reason"],
)
SCRIPT_SANDBOX = Gauge(
    "inferbus_worker_script_sandbox",
    "1 per version running preprocessor.py, labelled with whether its processes "
    "have their own network namespace (network=isolated) or not (shared).",
    ["model", "version", "network"],
)

_SHARED_START = 1 << 20


class ScriptFailure(Exception):
    """A preprocessor.py call failed; `message` is one line for the callers."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class ScriptLoadError(FailedPrecondition):
    """preprocessor.py cannot be started (it raised at import, or no child came up)."""


@dataclass(frozen=True)
class ScriptLimits:
    """Pool size and sandbox limits (from `WorkerSettings`)."""

    pool_size: int = 2
    memory_bytes: int = 2 << 30
    cpu_s: float = 30.0
    timeout_s: float = 30.0
    start_timeout_s: float = 30.0


def clean_env(directory: Path) -> dict[str, str]:
    """The children's whole environment: nothing of the worker's (no credentials)."""
    return {
        "PATH": os.defpath,
        "LANG": "C.UTF-8",
        "HOME": str(directory),
        # One thread each: the pool is the parallelism, and RLIMIT_AS stays small.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@dataclass(eq=False)
class _Child:
    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    batches: Shared
    results: Shared
    ready: dict[str, Any] = field(default_factory=dict)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU:
            return f"exceeded its CPU time limit ({name})"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _memfd(name: str) -> int:
    fd = os.memfd_create(name)
    os.ftruncate(fd, _SHARED_START)
    return fd


class ScriptPool:
    """Sandboxed processes running one version's Python file (see module docstring).

    Args:
        directory: the version's verified directory.
        file: the Python file, relative to it.
        name: ``model/version``, in every message.
        limits: pool size and limits.
    """

    def __init__(self, directory: Path, file: str, name: str, limits: ScriptLimits) -> None:
        self.directory = directory
        self.file = file
        self.name = name
        self.limits = limits
        self.functions: set[str] = set()
        self.sandbox: dict[str, Any] = {}
        self.replaced = 0
        """Children killed or dead and replaced since start."""
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()
        self._spawning: set[asyncio.Task[None]] = set()
        self._closed = False

    async def _spawn(self) -> _Child:
        in_fd, out_fd = _memfd("inferbus-script-in"), _memfd("inferbus-script-out")
        try:
            child = await self._exec(in_fd, out_fd)
        except BaseException:
            os.close(in_fd)
            os.close(out_fd)
            raise
        # From here `_reap` closes the two files.
        return await self._started(child)

    async def _exec(self, in_fd: int, out_fd: int) -> _Child:
        spec = {
            "directory": str(self.directory),
            "file": self.file,
            "memory_bytes": self.limits.memory_bytes,
            "in_fd": in_fd,
            "out_fd": out_fd,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-m",
            "inferbus_worker.scriptchild",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=clean_env(self.directory),
            cwd=str(self.directory),
            start_new_session=True,
            close_fds=True,
            pass_fds=(in_fd, out_fd),
        )
        assert proc.stdin is not None and proc.stdout is not None
        child = _Child(proc, proc.stdout, proc.stdin, Shared(in_fd), Shared(out_fd))
        self._children.add(child)
        return child

    async def _started(self, child: _Child) -> _Child:
        """`child` once it said it is ready (reaped and raising otherwise)."""
        try:
            async with asyncio.timeout(self.limits.start_timeout_s):
                kind, payload = await self._read(child)
        except TimeoutError:
            await self._reap(child)
            raise ScriptLoadError(
                f"{self.name}: {self.file} did not start within {self.limits.start_timeout_s:g} s"
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self._reap(child)
            raise ScriptLoadError(
                f"{self.name}: {self.file}: its process {_describe_exit(code)} while starting"
            ) from None
        if kind != READY:
            await self._reap(child)
            raise ScriptLoadError(f"{self.name}: {one_line(payload.decode(errors='replace'))}")
        child.ready = json.loads(payload)
        return child

    async def _read(self, child: _Child) -> tuple[bytes, bytes]:
        head = await child.reader.readexactly(HEADER.size)
        kind, _, size = HEADER.unpack(head)
        if kind == OK:
            # Copied out: the child's next result overwrites the shared file, and
            # the engine may still be using these arrays then.
            return kind, bytes(child.results.view(size))
        payload = await child.reader.readexactly(size) if size else b""
        return kind, payload

    async def _reap(self, child: _Child, *, grace: bool = True) -> int | None:
        """Kill (if still running) and wait for `child`; its exit status."""
        self._children.discard(child)
        if grace and child.proc.returncode is None:
            # A crashed child may still be closing: give it a moment before SIGKILL.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):
                    await child.proc.wait()
        dead_already = child.proc.returncode
        child.kill()
        with contextlib.suppress(Exception):
            child.writer.close()
        code = await child.proc.wait()
        for fd in (child.batches.fd, child.results.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        return dead_already if dead_already is not None else code

    async def start(self) -> None:
        """Start every child; the version loads only when all came up.

        Raises:
            ScriptLoadError: the file raised at import or a child did not start.
        """
        try:
            children = await asyncio.gather(*(self._spawn() for _ in range(self.limits.pool_size)))
        except BaseException:
            await self.close()
            raise
        first = children[0].ready
        self.functions = set(first["functions"])
        self.sandbox = first["sandbox"]
        for child in children:
            self._idle.put_nowait(child)
        model, _, version = self.name.partition("/")
        SCRIPT_SANDBOX.labels(model, version, self.sandbox.get("network", "shared")).set(1)
        extra = {"model": model, "version": version}
        if self.sandbox.get("network") != "isolated" or self.sandbox.get("problems"):
            log.warning("preprocessor.py sandbox: %s", json.dumps(self.sandbox), extra=extra)
        else:
            log.info("preprocessor.py sandbox: %s", json.dumps(self.sandbox), extra=extra)

    def _replace(self, dead: _Child | None) -> None:
        """Reap `dead` (when not yet) and start a child to take its place, in the
        background."""
        if self._closed:
            return  # `close` reaps what is left
        self.replaced += 1
        task = asyncio.create_task(self._respawn(dead), name=f"script-respawn-{self.name}")
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _respawn(self, dead: _Child | None) -> None:
        if dead is not None:
            await self._reap(dead, grace=False)
        delay = 0.1
        while not self._closed:
            try:
                child = await self._spawn()
            except ScriptLoadError as exc:
                log.error("restarting a preprocessor.py process failed: %s", exc.message)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if self._closed:
                await self._reap(child)
                return
            self._idle.put_nowait(child)
            return

    async def call(self, kind: bytes, tensors: Sequence[Tensor], deadline: float) -> list[Tensor]:
        """Run ``preprocess`` (`PRE`) or ``postprocess`` (`POST`) on one batch.

        Args:
            kind: `PRE` or `POST`.
            tensors: the batch.
            deadline: ``time.monotonic()`` by which the answer must be back.

        Raises:
            ScriptFailure: timed out, the child died, or the function raised.
        """
        function = "preprocess" if kind == PRE else "postprocess"
        where = f"{self.name}: {self.file} {function}()"
        budget = deadline - time.monotonic()
        if budget <= 0:
            raise ScriptFailure(
                f"{where}: timed out: the batch's deadline passed before it could run", "timeout"
            )
        loop = asyncio.get_running_loop()
        at = loop.time() + budget
        try:
            async with asyncio.timeout_at(at):
                child = await self._idle.get()
        except TimeoutError:
            raise ScriptFailure(
                f"{where}: timed out waiting for a free process before the batch's "
                f"deadline ({self.limits.pool_size} busy or restarting)",
                "timeout",
            ) from None
        t0 = time.monotonic()
        keep = False
        try:
            size = child.batches.write(tensor_frame_parts(tensors))
            async with asyncio.timeout_at(at):
                child.writer.write(HEADER.pack(kind, self.limits.cpu_s, size))
                await child.writer.drain()
                reply, payload = await self._read(child)
            if reply == OK:
                keep = True
                try:
                    return decode_tensors(payload)
                except FrameError as exc:
                    raise ScriptFailure(f"{where}: bad result frame: {exc}", "invalid") from None
            if reply == ERROR:
                keep = True
                raise ScriptFailure(
                    f"{where}: {one_line(payload.decode(errors='replace'))}", "exception"
                )
            raise ScriptFailure(f"{where}: unexpected reply {reply!r}", "crash")
        except TimeoutError:
            took = time.monotonic() - t0
            raise ScriptFailure(
                f"{where}: timed out after {took:.2f} s (the batch's deadline); "
                "its process was killed and replaced",
                "timeout",
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self._reap(child)
            raise ScriptFailure(
                f"{where}: its process {_describe_exit(code)}; the process was replaced",
                "crash",
            ) from None
        finally:
            if keep:
                self._idle.put_nowait(child)
            else:
                # Killed now, reaped (and replaced) in the background: the batch's
                # callers are answered without waiting for the process to go.
                child.kill()
                self._replace(child if child in self._children else None)

    async def close(self) -> None:
        """Kill every child (in-flight calls fail) and stop replacing them."""
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*self._spawning, return_exceptions=True)
        await asyncio.gather(*(self._reap(c) for c in list(self._children)))
        model, _, version = self.name.partition("/")
        with contextlib.suppress(KeyError):
            SCRIPT_SANDBOX.remove(model, version, self.sandbox.get("network", "shared"))


def _fits(spec: TensorSpec, shape: Sequence[int]) -> bool:
    return len(spec.shape) == len(shape) and all(
        want == -1 or want == got for want, got in zip(spec.shape, shape, strict=True)
    )


def conform(
    tensors: Sequence[Tensor], specs: Sequence[TensorSpec], rows: int | None, what: str
) -> dict[str, np.ndarray]:
    """The tensors `specs` name, checked against them, as arrays.

    Args:
        rows: the batch's rows (None: no batch axis, not checked).
        what: for messages, e.g. ``m/1: preprocessor.py preprocess()``.

    Raises:
        ScriptFailure: a tensor is missing or does not fit its spec.
    """
    by_name = {t.name: t for t in tensors}
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        t = by_name.get(spec.name)
        if t is None:
            raise ScriptFailure(
                f"{what} returned no '{spec.name}' (returned {sorted(by_name)})", "invalid"
            )
        if t.datatype != spec.datatype or not _fits(spec, t.shape):
            raise ScriptFailure(
                f"{what} returned '{spec.name}' as {t.datatype} {list(t.shape)}; the config "
                f"declares {spec.datatype} {spec.shape}",
                "invalid",
            )
        if rows is not None and t.shape[0] != rows:
            raise ScriptFailure(
                f"{what} returned '{spec.name}' with {t.shape[0]} rows for a batch of {rows}; "
                "the batch axis must keep one row per input row",
                "invalid",
            )
        out[spec.name] = t.as_numpy()
    return out


class ScriptProcessing:
    """``preprocess`` / ``postprocess`` of one version, run in its `ScriptPool`."""

    def __init__(self, config: ModelConfig, pool: ScriptPool) -> None:
        self.pool = pool
        self.has_pre = "preprocess" in pool.functions
        self.has_post = "postprocess" in pool.functions
        self._engine_inputs = config.engine_inputs()
        self._outputs = config.outputs
        self._batched = config.max_batch_size > 0
        self.engine_outputs = [s.name for s in config.engine_outputs()]
        """Outputs to ask the engine for."""
        model, _, version = pool.name.partition("/")
        self._labels = {"model": model, "version": version}

    async def _run(
        self,
        kind: bytes,
        arrays: Mapping[str, np.ndarray],
        specs: Sequence[TensorSpec],
        rows: int,
        deadline: float,
    ) -> dict[str, np.ndarray]:
        stage = "pre" if kind == PRE else "post"
        try:
            tensors = [tensor_from_numpy(n, a) for n, a in arrays.items()]
            result = await self.pool.call(kind, tensors, deadline)
            function = "preprocess" if kind == PRE else "postprocess"
            what = f"{self.pool.name}: {self.pool.file} {function}()"
            return conform(result, specs, rows if self._batched else None, what)
        except ScriptFailure as exc:
            SCRIPT_FAILURES.labels(**self._labels, stage=stage, reason=exc.reason).inc()
            raise

    async def pre(
        self, inputs: Mapping[str, np.ndarray], rows: int, deadline: float
    ) -> dict[str, np.ndarray]:
        """Engine inputs from the client inputs of a batch of `rows` rows."""
        return await self._run(PRE, inputs, self._engine_inputs, rows, deadline)

    async def post(
        self, outputs: Mapping[str, np.ndarray], rows: int, deadline: float
    ) -> dict[str, np.ndarray]:
        """Client outputs from the engine outputs of a batch of `rows` rows."""
        return await self._run(POST, outputs, self._outputs, rows, deadline)

    async def close(self) -> None:
        await self.pool.close()


async def start_script(
    config: ModelConfig, directory: Path, name: str, limits: ScriptLimits
) -> ScriptProcessing | None:
    """The version's `ScriptProcessing`, started; None when its config names no Python file.

    Raises:
        ScriptLoadError: the file raised at import or its processes did not start.
    """
    proc = config.processing
    if proc is None or proc.python is None:
        return None
    pool = ScriptPool(directory, proc.python, name, limits)
    await pool.start()
    return ScriptProcessing(config, pool)
