"""Pushing a scikit-learn (or LightGBM) pickle: the registry serves its ONNX conversion.

A push whose files hold ``model.pkl`` or ``model.joblib`` (and no
``model.onnx``) is converted at push time by `inferbus_registry.sklearnsandbox`
in a child process: skl2onnx turns the estimator into ``model.onnx``, the
child runs the ONNX model with onnxruntime and the pickle on a sample
(``sample.npy`` when the push has one, else rows generated from the input
shape) and the largest difference goes into ``conversion.json`` and the
version's manifest. What is stored, signed and served is ``model.onnx``:
the pickle and the sample are not kept, so no worker (nor anyone downloading
the version) ever unpickles anything.

Unpickling is running code: the child gets a scrubbed environment, an empty
working directory, address-space and CPU limits and a wall-clock timeout
after which its process group is killed (docs/security.md says who may push).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferbus_common.errors import InvalidArgument
from inferbus_registry.records import FileInfo

log = logging.getLogger(__name__)

#: Names of a pushed pickle the registry converts.
PICKLE_FILES = ("model.pkl", "model.joblib")
#: Rows the converted model is checked on (optional; generated when absent).
SAMPLE_FILE = "sample.npy"
#: What a converted version stores besides model.onnx: the conversion's record.
CONVERSION_FILE = "conversion.json"
CONVERTED_FILE = "model.onnx"


@dataclass(frozen=True)
class ConversionLimits:
    """How far the registry lets a conversion go (settings ``convert_*``)."""

    enabled: bool = True
    timeout_s: float = 300.0
    memory_mb: int = 4096
    tolerance: float = 1e-4
    concurrency: int = 2
    """Conversions running at once; further pickle pushes wait for a slot."""


@dataclass(frozen=True)
class Conversion:
    """A finished conversion: the record stored with the version and its timings."""

    record: dict[str, Any]
    timings_s: dict[str, float]

    def record_json(self) -> bytes:
        """``conversion.json``'s bytes (stable: a re-push of the same pickle hashes the same)."""
        return (json.dumps(self.record, indent=2, sort_keys=True) + "\n").encode()


def pickle_source(files: dict[str, FileInfo], model: str) -> str | None:
    """The pushed pickle to convert, or None when the push has none.

    Raises:
        InvalidArgument: both pickles, or a pickle beside a ``model.onnx``.
    """
    found = [name for name in PICKLE_FILES if name in files]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidArgument(f"{model}: push either model.pkl or model.joblib, not both")
    if CONVERTED_FILE in files:
        raise InvalidArgument(
            f"{model}: the push has {found[0]} and {CONVERTED_FILE}; the registry converts the "
            "pickle to model.onnx itself, push one of them"
        )
    return found[0]


def _child_env(home: Path) -> dict[str, str]:
    """Only what Python needs: no store keys, tokens or signing-key paths."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        # One thread each: a conversion shares the registry's CPUs.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    return env


async def convert_pickle(
    spool_root: Path,
    source: str,
    source_sha256: str,
    model: str,
    limits: ConversionLimits,
    *,
    with_sample: bool,
) -> Conversion:
    """Convert the spooled `source` in a sandboxed child; writes ``model.onnx`` beside it.

    Raises:
        InvalidArgument: conversions are off, the estimator is not supported (named),
            the ONNX model differs from the pickle beyond the tolerance, or the
            child ran out of time or memory.
    """
    if not limits.enabled:
        raise InvalidArgument(
            f"{model}: this registry does not convert pickles "
            "(INFERBUS_REGISTRY_CONVERT_PICKLES=false); push an ONNX model"
        )
    work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="convert-", dir=spool_root))
    out = work / "out"
    out.mkdir()
    request = {
        "source": str(spool_root / source),
        "source_name": source,
        "source_sha256": source_sha256,
        "sample": str(spool_root / SAMPLE_FILE) if with_sample else "",
        "out": str(out),
        "memory_mb": limits.memory_mb,
        "cpu_s": max(1, int(limits.timeout_s) + 1),
        "tolerance": limits.tolerance,
    }
    (work / "request.json").write_text(json.dumps(request))
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-m",
        "inferbus_registry.sklearnsandbox",
        str(work / "request.json"),
        cwd=str(work),
        env=_child_env(work),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout kills all of it
        close_fds=True,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), limits.timeout_s)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        raise InvalidArgument(
            f"{model}: converting {source} took longer than the registry's "
            f"{limits.timeout_s:g} s; push an ONNX model"
        ) from None
    except BaseException:
        _kill_group(proc.pid)
        await proc.wait()
        raise
    finally:
        _kill_group(proc.pid)  # anything it left running
    wall_s = time.monotonic() - t0
    report_path = out / "report.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.is_file() else {}
    if proc.returncode != 0 or "error" in report:
        if "error" in report:
            raise InvalidArgument(f"{model}: {report['error']}")
        tail = output.decode("utf-8", "replace").strip().splitlines()[-3:]
        why = (
            f"killed by signal {-proc.returncode}"
            if proc.returncode is not None and proc.returncode < 0
            else f"exit status {proc.returncode}"
        )
        raise InvalidArgument(
            f"{model}: converting {source} failed ({why}; memory limit "
            f"{limits.memory_mb} MiB): {' | '.join(tail) or 'no output'}"
        )
    os.replace(out / CONVERTED_FILE, spool_root / CONVERTED_FILE)
    timings = dict(report.pop("_timings_s", {}))
    timings["total"] = round(wall_s, 3)
    log.info(
        "converted %s of %s (%s) in %.2f s, max difference %s",
        source,
        model,
        report.get("estimator"),
        wall_s,
        report.get("max_abs_diff"),
    )
    return Conversion(record=report, timings_s=timings)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def file_info(path: Path) -> FileInfo:
    """SHA-256 and size of a file the registry wrote into the spool."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return FileInfo(sha256=digest.hexdigest(), size=path.stat().st_size)
