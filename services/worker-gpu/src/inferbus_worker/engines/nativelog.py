"""Native libraries' log lines (ONNX Runtime, TensorRT, CUDA) through the JSON logger.

ONNX Runtime's Python API has no hook for its C++ logger: its warnings
(coloured, one per line) go straight to file descriptor 2, in the middle of
the worker's JSON log. `NativeLogRelay` puts a pipe in place of fd 2 and a
reader thread re-emits each line: a line that already is a JSON object (the
worker's own logger writes to ``sys.stderr``, which is fd 2 too) passes
through unchanged, any other becomes a JSON record of the
``inferbus_worker.native`` logger at the level the line names (ONNX
Runtime's ``[W:onnxruntime:...]``, TensorRT's ``[W]``), colours stripped.

The reader writes straight to the original stderr and never through
``logging``'s handlers: a handler writing to fd 2 would write into the pipe
the reader drains, and block it once the pipe is full.

The last lines are kept (`lines_since`) so that a failed engine load can
quote the provider's own words (why CUDA did not start).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import re
import threading

log = logging.getLogger("inferbus_worker.native")

_SYNC = "\x00inferbus-native-log-sync"
"""Written to fd 2 by `NativeLogRelay.lines_since`; never relayed."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ORT_LEVEL = re.compile(r"\[([VIWEF]):onnxruntime")
_TRT_LEVEL = re.compile(r"\[(?:TRT|TensorRT)\]\s*\[([VIWEF])\]")
_LEVELS = {
    "V": logging.DEBUG,
    "I": logging.INFO,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}


def native_level(line: str) -> int:
    """The logging level a native line names (WARNING when it names none)."""
    match = _ORT_LEVEL.search(line) or _TRT_LEVEL.search(line)
    return _LEVELS[match.group(1)] if match else logging.WARNING


class NativeLogRelay:
    """fd 2 → pipe → reader thread → JSON lines on the original stderr.

    Args:
        keep: how many recent native lines `lines_since` can return.
    """

    def __init__(self, keep: int = 200) -> None:
        self._recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=keep)
        self._seq = 0
        self._lock = threading.Lock()
        self._synced = threading.Condition(self._lock)
        self._syncs_sent = 0
        self._syncs_seen = 0
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether fd 2 is relayed now."""
        return self._saved is not None

    def start(self) -> None:
        """Put the pipe in place of fd 2 and start the reader (idempotent)."""
        if self._saved is not None:
            return
        read_fd, write_fd = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(
            target=self._read, args=(read_fd,), name="native-log", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Give fd 2 back and let the reader finish what the pipe still holds."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees EOF
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(saved)

    def mark(self) -> int:
        """A position in the stream of native lines (for `lines_since`)."""
        with self._lock:
            return self._seq

    def lines_since(self, mark: int) -> list[str]:
        """Native (non-JSON) lines written after `mark`, oldest first.

        Waits (up to a second) until the reader has read everything written to
        fd 2 before the call: a sync line goes through the pipe behind them.
        """
        if self._saved is not None:
            with self._lock:
                self._syncs_sent += 1
                want = self._syncs_sent
            _write(2, _SYNC)
            with self._synced:
                self._synced.wait_for(lambda: self._syncs_seen >= want, timeout=1.0)
        with self._lock:
            return [line for seq, line in self._recent if seq > mark]

    def _read(self, read_fd: int) -> None:
        out = self._saved
        assert out is not None
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._relay(raw.decode("utf-8", "replace"), out)
            if pending:
                self._relay(pending.decode("utf-8", "replace"), out)

    def _relay(self, line: str, out: int) -> None:
        if line == _SYNC:
            with self._synced:
                self._syncs_seen += 1
                self._synced.notify_all()
            return
        if line.startswith("{"):
            _write(out, line)
            return
        text = _ANSI.sub("", line).strip()
        if not text:
            return
        with self._lock:
            self._seq += 1
            self._recent.append((self._seq, text))
        level = native_level(text)
        if not log.isEnabledFor(level):
            return
        record = log.makeRecord(log.name, level, "(native)", 0, text, (), None)
        _write(out, _format(record))


def _format(record: logging.LogRecord) -> str:
    """A record as the root handler would write it (its formatter), on one line."""
    for handler in logging.getLogger().handlers:
        if handler.formatter is not None:
            return handler.formatter.format(record).replace("\n", " ")
    return record.getMessage()


def _write(fd: int, line: str) -> None:
    data = (line + "\n").encode("utf-8", "replace")
    while data:
        try:
            written = os.write(fd, data)
        except OSError:
            return  # stderr is gone (a closed terminal): nothing to tell it
        data = data[written:]


RELAY = NativeLogRelay()
"""The process's relay; the worker's entry point starts it (`relay_native_logs`)."""


def relay_native_logs() -> NativeLogRelay:
    """Start relaying fd 2 through the JSON logger (once per process).

    At exit the relay gives fd 2 back after draining the pipe, so what the
    interpreter writes last (an uncaught exception's traceback) is not lost.
    """
    if not RELAY.running:
        RELAY.start()
        atexit.register(RELAY.stop)
    return RELAY
