"""The one rule for how many waiting requests (or micro-batches) run together.

Both places that form batches use it: the batcher, cutting its queue into
micro-batches, and the worker, merging micro-batches that queued up while its
engine was busy. The rule follows Triton's dynamic batcher:

* rows are never split: a unit (a request, or a micro-batch) that would take
  the batch past ``max_batch_size`` starts the next one;
* with ``preferred_batch_sizes``, the largest preferred size that a prefix of
  the waiting units adds up to is taken;
* otherwise, once waiting is over (the queue delay passed, or the caller never
  waits, as a worker with a free engine does), everything that fits goes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferbus_common.modelconfig import ModelConfig


@dataclass(frozen=True, slots=True)
class BatchRule:
    """A version's batch-size rule.

    Attributes:
        max_batch_size: most rows in one batch (0: no batching, one unit per batch).
        preferred: preferred batch sizes (within ``1..max_batch_size``).
    """

    max_batch_size: int
    preferred: frozenset[int] = frozenset()

    @classmethod
    def of(cls, config: ModelConfig) -> BatchRule:
        """The rule of a model config (preferred sizes above the maximum are dropped)."""
        top = max(config.max_batch_size, 1)
        preferred = frozenset(p for p in config.batching.preferred_batch_sizes if 0 < p <= top)
        return cls(config.max_batch_size, preferred)

    @property
    def max_preferred(self) -> int:
        """The largest preferred size (``max_batch_size`` without any)."""
        return max(self.preferred) if self.preferred else self.max_batch_size

    @property
    def min_preferred(self) -> int:
        """The smallest preferred size (``max_batch_size`` without any)."""
        return min(self.preferred) if self.preferred else self.max_batch_size

    def cut(self, rows: Iterable[int], *, waited: bool) -> int:
        """How many of the waiting units (their rows, in order) form the next batch.

        Args:
            rows: rows of each waiting unit, in the order they would be taken.
            waited: waiting for more is over (the delay passed, or the caller
                does not wait): then everything that fits goes.

        Returns:
            The number of units to take now; 0 means wait for more (only when
            `waited` is false, or nothing waits).
        """
        if self.max_batch_size == 0:
            return 1 if any(True for _ in rows) else 0
        total = n = best = 0
        full = False
        for r in rows:
            if n:
                if best == 0 and total + r > self.max_preferred:
                    # Adding this one would pass every preferred size: what is
                    # pending is the best batch short of waiting.
                    best = n
                if total + r > self.max_batch_size:
                    full = True
                    break
            total += r
            n += 1
            if total in self.preferred:
                best = n
            if total >= self.max_batch_size:
                full = True
                break
        if best and not waited:
            return best
        if full or waited or total >= self.max_preferred:
            return n
        return 0

    def merge(self, rows: Iterable[int]) -> int:
        """How many waiting units a worker with a free engine runs together now:
        the largest preferred size a prefix adds up to, else all that fit (at least 1)."""
        units = list(rows)
        return max(1, self.cut(units, waited=False) or self.cut(units, waited=True))
