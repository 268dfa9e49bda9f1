"""A small byte-progress bar for uploads and downloads, drawn on stderr.

No dependency: one line redrawn with ``\\r`` at most every `interval_s`, and a
final line with the total and the mean rate. It is drawn only when stderr is a
terminal or the user asked for it (``--progress``), so scripts and CI logs
stay clean; the byte count is kept either way, so callers (and tests) can check
that what was reported equals what was sent.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class ProgressBar:
    """Counts bytes and draws ``label [#####.....]  42% 12.0/28.6 MiB 80.1 MiB/s``.

    Args:
        total: bytes expected (0 = unknown: no bar, only the count).
        label: what is moving, e.g. the file name.
        stream: where to draw (stderr by default).
        enabled: draw at all; None = only when `stream` is a terminal.
        interval_s: least time between two redraws.
        width: characters of the bar itself.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        interval_s: float = 0.1,
        width: int = 30,
    ) -> None:
        self.total = max(0, total)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self._stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._interval = interval_s
        self._width = width
        self._t0 = time.monotonic()
        self._last_draw = float("-inf")
        self._closed = False

    def advance(self, n: int) -> None:
        """Count `n` more bytes; redraw when the last redraw is old enough."""
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= self._interval:
            self._last_draw = now
            self._draw(now, final=False)

    def close(self) -> None:
        """Draw the final line (total and mean rate) and end it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._draw(time.monotonic(), final=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self, now: float | None = None) -> str:
        """The text of the bar as of `now` (monotonic seconds)."""
        elapsed = max(1e-9, (now if now is not None else time.monotonic()) - self._t0)
        rate = f"{human_bytes(self.done / elapsed)}/s"
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * self._width)
            bar = "#" * filled + "." * (self._width - filled)
            return (
                f"{self.label} [{bar}] {frac * 100:3.0f}% "
                f"{human_bytes(self.done)}/{human_bytes(self.total)} {rate}"
            )
        return f"{self.label} {human_bytes(self.done)} {rate}"

    def _draw(self, now: float, *, final: bool) -> None:
        self._stream.write("\r" + self.line(now) + ("\n" if final else ""))
        self._stream.flush()
