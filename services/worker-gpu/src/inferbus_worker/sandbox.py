"""The sandbox a version's ``preprocessor.py`` runs in (issue 27), set up by the child itself.

`enter` runs in a fresh child process (``inferbus_worker.scriptchild``) before
the version's file is read, and cannot be undone by the code that follows:

1. **No network**: a new, empty network namespace (``unshare(CLONE_NEWNET)``;
   not even loopback is up, so every connect fails with ``ENETUNREACH``). As
   root this needs no more; as another user an unprivileged user namespace is
   tried (``CLONE_NEWUSER``, the child maps itself to uid 0 inside it). When
   neither is permitted (a container whose seccomp profile or missing
   ``CAP_SYS_ADMIN`` forbids ``unshare``) the child runs *without* network
   isolation, says so in its report, and the worker logs it at WARNING and
   exports it in ``inferbus_worker_script_sandbox``. There is no in-process
   fallback pretending otherwise: blocking ``socket`` in Python is bypassed
   by ``ctypes`` in one line.
2. **Read-only filesystem**: with the network namespace comes a mount
   namespace in which every mount is remounted read-only (the version
   directory included), mount events kept private.
3. **Limits**: ``RLIMIT_AS`` (memory), ``RLIMIT_CORE`` 0, ``RLIMIT_NOFILE``;
   ``RLIMIT_CPU`` is set per batch by the child loop (`cpu_limit`).
4. **No privileges**: every capability dropped (effective, permitted,
   inheritable, bounding set) and ``PR_SET_NO_NEW_PRIVS``, so the code can
   neither remount, re-enter namespaces, raise its hard limits nor gain
   privileges through a set-uid program. The child dies with the worker
   (``PR_SET_PDEATHSIG``).

The clean environment and closed file descriptors are the parent's part
(`inferbus_worker.scriptpool`). Linux only; see docs/security.md
("preprocessor.py sandbox") for what it does not cover.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
# statvfs f_flag bits → the mount flags to keep when remounting (a user namespace
# may not clear them).
_KEEP_FLAGS = {1: 0, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME}
_KEEP_FLAGS |= {2048: MS_NODIRATIME, 4096: MS_RELATIME}
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_CAP_VERSION_3 = 0x20080522


@dataclass
class SandboxReport:
    """What `enter` managed to set up (sent to the parent, logged, exported)."""

    network: str = "shared"
    """``isolated`` (own empty network namespace) or ``shared`` (none could be made)."""
    namespaces: str = ""
    """How: ``net+mnt`` (as root), ``user+net+mnt`` (unprivileged), or ''."""
    filesystem: str = "writable"
    """``read-only`` (every mount remounted read-only) or ``writable``."""
    readonly_failures: int = 0
    """Mounts that could not be remounted read-only (left as they were)."""
    capabilities: str = "kept"
    """``dropped`` or ``kept`` (capset refused)."""
    problems: list[str] = field(default_factory=list)
    """Why a step did not happen, one line each."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _unshare(libc: ctypes.CDLL, report: SandboxReport) -> bool:
    """A new network + mount namespace; True when made."""
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) == 0:
        report.namespaces = "net+mnt"
        return True
    report.problems.append(f"unshare(net+mnt): {_errno_text()}")
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) == 0:
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        except OSError as exc:
            report.problems.append(f"user namespace id maps: {exc}")
        report.namespaces = "user+net+mnt"
        return True
    report.problems.append(f"unshare(user+net+mnt): {_errno_text()}")
    return False


def _mount_points() -> list[str]:
    points: list[str] = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) > 4:
                # Octal escapes (\040 for a space) as the kernel writes them.
                points.append(fields[4].encode().decode("unicode_escape"))
    return points


def _read_only(libc: ctypes.CDLL, report: SandboxReport) -> None:
    """Every mount of this (new) mount namespace read-only, events kept private."""
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        report.problems.append(f"make mounts private: {_errno_text()}")
        return
    failed = 0
    for point in _mount_points():
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            failed += 1
            continue
        keep = 0
        for bit, ms in _KEEP_FLAGS.items():
            if flags & bit:
                keep |= ms
        target = point.encode()
        if libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None) != 0:
            failed += 1
    report.readonly_failures = failed
    report.filesystem = "read-only" if failed == 0 else "partly read-only"


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities(libc: ctypes.CDLL, report: SandboxReport) -> None:
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), ctypes.byref(data)) != 0:
        report.problems.append(f"capset: {_errno_text()}")
    else:
        report.capabilities = "dropped"
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        report.problems.append(f"no_new_privs: {_errno_text()}")


def enter(*, memory_bytes: int, max_files: int = 256) -> SandboxReport:
    """Isolate this process (see module docstring); irreversible. Returns what worked."""
    report = SandboxReport()
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if _unshare(libc, report):
        report.network = "isolated"
        _read_only(libc, report)
    _drop_capabilities(libc, report)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    return report


def cpu_limit(seconds: float) -> None:
    """Let this process use `seconds` more CPU time (all threads) before SIGXCPU ends it.

    ``RLIMIT_CPU`` counts the process's whole life, so the soft limit is moved
    before each batch; the hard limit stays where it was (without
    capabilities it cannot be raised, the soft one can up to it: the
    parent's wall-clock deadline is the limit the code cannot move).
    """
    if seconds <= 0:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
