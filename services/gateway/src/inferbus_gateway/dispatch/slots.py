"""A version's execution slots, read from the catalog at most every `ttl_s`.

An execution slot is one batch a worker can run at once: a version has its
ready workers' ``instance_count`` summed. The fast lane and the bundle rule
compare the requests in flight at this gateway with it on every request, so
the catalog is asked at most once per `ttl_s` per version.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_MAX_KEPT = 1024
"""(model, version) pairs kept (beyond it the cache starts over)."""


class SlotCount:
    """Cached ``slots(model, version)``.

    Args:
        slots: the version's execution slots as the catalog knows them now.
        ttl_s: how long a count is reused.
    """

    def __init__(self, slots: Callable[[str, str], int], ttl_s: float = 0.1) -> None:
        self._slots = slots
        self._ttl_s = ttl_s
        self._kept: dict[tuple[str, str], tuple[float, int]] = {}

    def __call__(self, model: str, version: str) -> int:
        """The version's execution slots (0: no ready worker, or unknown)."""
        now = time.monotonic()
        kept = self._kept.get((model, version))
        if kept is not None and kept[0] > now:
            return kept[1]
        if len(self._kept) >= _MAX_KEPT:
            self._kept.clear()
        count = self._slots(model, version)
        self._kept[(model, version)] = (now + self._ttl_s, count)
        return count
