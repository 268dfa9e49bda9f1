"""Child processes die with their parent, so a killed test run leaks no servers."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent() -> None:
    """``preexec_fn`` for `subprocess.Popen`: SIGKILL the child when its parent dies.

    Without this, a pytest run killed by a timeout (SIGKILL/SIGTERM skips every
    ``finally``) leaves nats-server, redis-server, weed and services running
    forever. Linux only (prctl); elsewhere a no-op.

    Note: the kernel ties this to the *thread* that forked the child. Starting a
    server from a thread that later exits kills the server with it; the thread
    pool of `asyncio.to_thread` keeps its threads until the loop closes, which
    is after the test that used it.
    """
    if sys.platform.startswith("linux"):
        _set_parent_death_signal()
