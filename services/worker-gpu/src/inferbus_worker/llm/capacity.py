"""`Capacity`: admission of generative requests by what the engine can still do in time.

vLLM queues whatever it is given and runs `max_num_seqs` at once; a request that
waits behind a long queue and then runs out of deadline has cost a slot and
produced nothing. A fixed bound (`max_num_seqs + max_waiting`) either refuses
bursts vLLM's own server would have served or admits requests that will time
out. `Capacity` keeps moving averages of this worker's recent requests (prefill
time, time per output token, time a running request holds its slot) and
estimates, for a new request, when it would start (the requests ahead of it
must finish first, `max_num_seqs` at a time) and how long it would run
(`max_tokens` of them). `VersionServer` refuses (429 with ``Retry-After``) only
a request whose estimate ends past its deadline; `max_waiting` stays a hard cap
on what one worker holds. With no finished request yet there is nothing to
estimate from, and everything up to the cap is admitted, as vLLM would.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Estimate:
    """When a new request would start and end, seconds from now."""

    ahead: int
    """Requests that must finish before it gets a running slot."""
    wait_s: float
    run_s: float

    @property
    def done_s(self) -> float:
        return self.wait_s + self.run_s


class Capacity:
    """Moving averages of one version's requests on this worker.

    Args:
        slots: vLLM's running slots (`max_num_seqs`).
        alpha: weight of the newest request in each average.
    """

    def __init__(self, slots: int, alpha: float = 0.2) -> None:
        if slots < 1 or not 0 < alpha <= 1:
            raise ValueError("slots must be positive and alpha in (0, 1]")
        self.slots = slots
        self._alpha = alpha
        self.samples = 0
        self.prefill_s = 0.0
        """Time from a request's start in the engine to its first token."""
        self.per_token_s = 0.0
        """Time per output token once it streams."""
        self.hold_s = 0.0
        """Time a request holds a running slot (its run, without its queueing)."""

    @property
    def known(self) -> bool:
        """Whether a finished request has been seen (estimates are 0 until then)."""
        return self.samples > 0

    def observe(self, *, prefill_s: float, per_token_s: float, hold_s: float) -> None:
        """Record one finished request."""
        if self.samples == 0:
            self.prefill_s, self.per_token_s, self.hold_s = prefill_s, per_token_s, hold_s
        else:
            a = self._alpha
            self.prefill_s += a * (prefill_s - self.prefill_s)
            self.per_token_s += a * (per_token_s - self.per_token_s)
            self.hold_s += a * (hold_s - self.hold_s)
        self.samples += 1

    def estimate(self, in_flight: int, max_tokens: int) -> Estimate:
        """For a request arriving while `in_flight` are held (running + waiting).

        The k-th request ahead of it in the queue starts when k slots free; a
        slot frees every ``hold_s / slots`` seconds on average.
        """
        ahead = max(0, in_flight - self.slots + 1)
        wait = ahead * self.hold_s / self.slots
        run = self.prefill_s + max_tokens * self.per_token_s
        return Estimate(ahead, wait, run)
