"""How the gateway answers a ModelInfer: a handler wrapped in steps.

The handler (`InferHandler`) reads resolve → validate → dispatch → decode;
the cross-cutting jobs are steps around it (`steps`), composed in the order
`__main__.build_pipeline` lists them (`call.compose`).
"""

from inferbus_gateway.pipeline.call import Closable, Handler, InferCall, Step, compose
from inferbus_gateway.pipeline.handler import Dispatch, InferHandler, Readiness
from inferbus_gateway.pipeline.steps import (
    Admit,
    AuditTrail,
    Fallback,
    Idempotency,
    Observers,
    Outcomes,
    Recorder,
    RequestMetrics,
    SharedMemory,
)

__all__ = [
    "Admit",
    "AuditTrail",
    "Closable",
    "Dispatch",
    "Fallback",
    "Handler",
    "Idempotency",
    "InferCall",
    "InferHandler",
    "Observers",
    "Outcomes",
    "Readiness",
    "Recorder",
    "RequestMetrics",
    "SharedMemory",
    "Step",
    "compose",
]
