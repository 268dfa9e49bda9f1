"""Fault injection under steady load: the reliability matrix of issue #11.

A `ChaosStack` is the whole platform as real processes, shaped so that every
fault in the matrix has something to hit: two workers, two gateways, Redis
(with a cluster limit configured, so the gateway really uses it) and the
registry on a real S3 endpoint. `ClosedLoad` keeps a few clients busy, each
request with its own deadline, and records one `Attempt` per request. A
`Fault` breaks something and heals it again; `run_fault` runs one fault under
load and turns the records into a `FaultReport`::

    with ChaosStack(tmp_path) as stack:
        stack.push(model_dir, "fraud")
        stack.wait_model_ready("fraud")
        report = asyncio.run(run_fault(stack, FAULTS["kill-batcher"], Shape.ci()))
        assert report.lost == 0 and report.hung == 0

How a request ends (`Attempt.status`):

* ``OK``: an answer equal to the reference computed in process by onnxruntime;
* ``WRONG``: an answer that is not (counted as lost: the client got garbage);
* a gRPC status name (``DEADLINE_EXCEEDED``, ``UNAVAILABLE``, ...): an
  explicit error the platform sent before the request's deadline;
* ``HANG``: nothing by the deadline plus a grace period (the client's own gRPC
  deadline fired, or the answer came too late to be of use).

The client retries only what `docs/architecture.md` calls safe to retry:
``UNAVAILABLE`` (the request was not computed), on the other gateway first,
within the request's original deadline and with the same request id.

The pieces live in `stack` (the processes and models), `load` (the clients),
`faults` (the matrix) and `run` (one fault under load); import them from here.
"""

from __future__ import annotations

import os

# Services are forked from this process while gRPC client threads run; gRPC's
# fork handlers then crash the child (SIGSEGV before exec). We never use gRPC
# in a forked child, so the handlers are not needed. Read when grpc is imported.
# The root conftest.py and scripts/test.sh set it for pytest; this line is for
# bench/reliability.py, which imports this module outside pytest.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from inferbus_testing.chaos.faults import CLUSTER_FAULTS, EDGE_FAULTS, FAULTS, Fault
from inferbus_testing.chaos.load import Attempt, ClosedLoad
from inferbus_testing.chaos.run import EXPLICIT, FaultReport, Shape, assert_nothing_lost, run_fault
from inferbus_testing.chaos.stack import (
    EDGE,
    FEATURES,
    INPUT,
    MODEL,
    OUTPUT,
    SLOW_CHANNELS,
    SLOW_MODEL,
    SLOW_SIDE,
    ChaosStack,
    ClusterChaosStack,
    build_slow_model,
    environment,
    make_models,
    ready_stack,
    rss_bytes,
)

__all__ = [
    "CLUSTER_FAULTS",
    "EDGE",
    "EDGE_FAULTS",
    "EXPLICIT",
    "FAULTS",
    "FEATURES",
    "INPUT",
    "MODEL",
    "OUTPUT",
    "SLOW_CHANNELS",
    "SLOW_MODEL",
    "SLOW_SIDE",
    "Attempt",
    "ChaosStack",
    "ClosedLoad",
    "ClusterChaosStack",
    "Fault",
    "FaultReport",
    "Shape",
    "assert_nothing_lost",
    "build_slow_model",
    "environment",
    "make_models",
    "ready_stack",
    "rss_bytes",
    "run_fault",
]
