"""The LLM worker's CPU priority, applied where the scheduler weighs it.

vLLM's engine never lets go of a CPU while it generates: besides the core that
computes, the processes of its executor wait for each other on a shared-memory
ring by spinning (``sched_yield`` in a loop, for a second after every read).
A yield only gives way to tasks in the spinner's own scheduling group. Linux
groups processes by session (autogroup, ``/proc/sys/kernel/sched_autogroup_enabled``)
and weighs the groups equally whatever the niceness inside them; the inferbus
services each run in a session of their own (``inferbus up``, the test harness),
so nats-server and the gateway, which carry every chunk of a stream, waited
for the engine's group to use up its slice: chunks left in bursts and first
tokens came 100–200 ms late (bench/findings.md, round 9). vLLM's own server
does not meet this because its front end shares the engine's group.

`lower_priority` puts the worker, and the engine processes it starts (they
inherit both), at the configured niceness, and when the worker leads its own
session it sets that session's autogroup niceness too: then the relay runs when
a chunk comes and the engine gets every cycle the relay does not use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

AUTOGROUP = Path("/proc/self/autogroup")


def _autogroup_nice(text: str) -> int | None:
    """The niceness in an autogroup file's text (``/autogroup-42 nice 0``)."""
    parts = text.split()
    if len(parts) == 3 and parts[1] == "nice":
        try:
            return int(parts[2])
        except ValueError:
            return None
    return None


def lower_priority(nice: int, autogroup: Path = AUTOGROUP) -> list[str]:
    """Run at niceness `nice` at least (never raises a priority); what was changed, for the log.

    The process niceness always; the session's autogroup niceness only when this
    process leads its session (the group is then this worker's alone) and the
    kernel groups by session. Failures are logged, never raised: a priority is
    an optimisation.
    """
    changed: list[str] = []
    if nice <= 0:
        return changed
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            changed.append(f"process nice {nice}")
    except OSError as exc:
        log.warning("could not lower the process priority to nice %d: %s", nice, exc)
    if os.getsid(0) != os.getpid():
        return changed
    try:
        current = _autogroup_nice(autogroup.read_text())
        if current is not None and current < nice:
            autogroup.write_text(str(nice))
            changed.append(f"session (autogroup) nice {nice}")
    except FileNotFoundError:
        pass  # no autogroup scheduling in this kernel
    except OSError as exc:
        log.warning("could not lower the session's autogroup priority to %d: %s", nice, exc)
    return changed
