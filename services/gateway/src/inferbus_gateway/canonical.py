"""Protocol-neutral inference request and response.

The gRPC and REST layers convert their wire messages to and from these; the
`InferenceService` sees nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferbus_common.codec import Tensor
from inferbus_common.sequences import SequenceFlags

if TYPE_CHECKING:
    from inferbus_gateway.triton.sequences import SequenceTurn


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a tensor's bytes are in a registered system shared-memory region
    (Triton's ``shared_memory_region``/``_byte_size``/``_offset`` parameters)."""

    region: str
    byte_size: int
    offset: int = 0


@dataclass(slots=True)
class InferRequest:
    """One inference request as the gateway understands it."""

    model: str
    version: str
    id: str
    inputs: list[Tensor]
    outputs: list[str] = field(default_factory=list)
    """Requested output names; empty means every output."""
    priority: int = 0
    timeout_s: float | None = None
    """Relative timeout the client asked for (None: the model's default)."""
    traceparent: str = ""
    tenant: str = ""
    """Set by admission control from the authenticated caller."""
    sticky_key: str = ""
    """Value of the client header the model's route is sticky on (``header:<Name>``)."""
    classification: dict[str, int] = field(default_factory=dict)
    """Output name → number of top classes to answer instead of the tensor
    (Triton's classification extension, `inferbus_gateway.triton.classification`)."""
    sequence: SequenceFlags | None = None
    """Triton's ``sequence_id``/``sequence_start``/``sequence_end`` (stateful models)."""
    turn: SequenceTurn | None = None
    """The request's place in its sequence's order, taken when a stream read it
    (`inferbus_gateway.triton.sequences.SequenceRouter.turn`); None: taken when sent."""
    streaming: bool = False
    """Came over ModelStreamInfer (decoupled models are served only there)."""
    shm_inputs: dict[str, ShmRef] = field(default_factory=dict)
    """Inputs whose bytes are in system shared memory (read before validation)."""
    shm_outputs: dict[str, ShmRef] = field(default_factory=dict)
    """Outputs to write into system shared memory instead of the answer."""


@dataclass(slots=True)
class InferResponse:
    """The answer to an `InferRequest`."""

    model: str
    version: str
    id: str
    outputs: list[Tensor]
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Stage timings: gateway, queue, compute, total (milliseconds)."""
    digest: str = ""
    """Digest of the artifact that computed the answer."""
    degraded: str = ""
    """Non-empty when this is a fallback answer: why the model itself did not answer."""
    shm_outputs: dict[str, ShmRef] = field(default_factory=dict)
    """Outputs written into system shared memory (their `Tensor.data` is empty)."""
