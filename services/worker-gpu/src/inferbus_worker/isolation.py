"""Which requests of a rejected engine batch are at fault, and the results of the rest.

When the engine refuses a whole batch (`EngineInputError`: a string that
does not parse, text that is not UTF-8, an index out of range) or fails on it
for good (`PermanentEngineError`: a model that breaks on some values), the
cause is usually one request's rows; the other requests in the micro-batch are valid
and must not fail with it. `run_alone` runs each request's rows on their own
and joins the results of those that computed, so the runner answers those as
usual and only the culprits with their error. A model fault that is the
same for every input still fails every request, each with its own message.

Blocking (engine runs): called in the runner's engine thread pool.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferbus_common.errors import StatusCode
from inferbus_worker.engines import Engine, EngineError, EngineInputError
from inferbus_worker.microbatch import LiveRequest


@dataclass(slots=True)
class Isolated:
    """The outcome of running a rejected batch's requests one by one.

    Attributes:
        outputs: engine outputs of the requests that computed, joined on axis 0.
        requests: those requests, their rows re-based on `outputs`.
        rejected: each failed request with the status and message to answer.
        seconds: engine time spent.
    """

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    requests: list[LiveRequest] = field(default_factory=list)
    rejected: list[tuple[LiveRequest, StatusCode, str]] = field(default_factory=list)
    seconds: float = 0.0


def run_alone(
    engine: Engine,
    inputs: Mapping[str, np.ndarray],
    requests: Sequence[LiveRequest],
    output_names: Sequence[str],
) -> Isolated:
    """Run each request's rows of `inputs` alone (a batched model's batch axis 0).

    A request the engine refuses is answered ``INVALID_ARGUMENT`` with the
    engine's message; one that fails otherwise ``INTERNAL`` with it (no
    retry: the batch already failed once, and the failure is reported
    rather than hidden behind redeliveries).
    """
    result = Isolated()
    parts: list[dict[str, np.ndarray]] = []
    row = 0
    t0 = time.perf_counter()
    for r in requests:
        feeds = {name: arr[r.start : r.stop] for name, arr in inputs.items()}
        try:
            out = engine.run(feeds, output_names)
        except EngineInputError as exc:
            result.rejected.append((r, StatusCode.INVALID_ARGUMENT, exc.message))
            continue
        except EngineError as exc:
            result.rejected.append((r, StatusCode.INTERNAL, exc.message))
            continue
        parts.append(out)
        result.requests.append(LiveRequest(r.entry, row))
        row += r.entry.rows
    result.seconds = time.perf_counter() - t0
    if parts:
        result.outputs = {
            name: np.concatenate([p[name] for p in parts], axis=0) for name in output_names
        }
    return result
