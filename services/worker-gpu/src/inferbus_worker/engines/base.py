"""The engine contract every backend implements, and what they share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from inferbus_common.engineconfig import DeviceKind
from inferbus_common.errors import FailedPrecondition, Internal, InvalidArgument
from inferbus_common.modelconfig import ModelConfig


class EngineError(Internal):
    """The engine failed for a reason that is not the input's fault."""


class PermanentEngineError(EngineError):
    """The engine failed in a way that will recur for the same inputs, on any worker
    (a kernel failing on its data), and not through the input's fault: answered
    INTERNAL at once, never retried."""


class ProviderUnavailable(FailedPrecondition, EngineError):
    """A version that may not compute on the CPU did not get its GPU provider here
    (no visible GPU, CUDA libraries missing, TensorRT failing to start).

    A load failure that retrying on this worker cannot fix: its code is
    FAILED_PRECONDITION (first in the MRO), so the version's state becomes
    ``failed permanently: <this text>`` and clients get FAILED_PRECONDITION
    naming it, instead of answers computed on the CPU. Still an `EngineError`
    for code that catches any engine failure.
    """


class EngineInputError(InvalidArgument):
    """The engine rejected the inputs (shape, type, names): retrying cannot help."""


@runtime_checkable
class Engine(Protocol):
    """A loaded model that computes outputs from inputs.

    `run` is called from up to ``instance_count`` threads at once (the worker
    runs engines in a thread pool; the backends release the GIL while
    computing), so implementations must be thread-safe.
    """

    @property
    def description(self) -> str:
        """Backend and providers in words, for logs and status."""
        ...

    @property
    def device_kind(self) -> DeviceKind:
        """Where the loaded engine really computes (``cpu`` or ``gpu``)."""
        ...

    def load(self) -> None:
        """Load the artifact and allocate what running needs (slow; run in a thread)."""
        ...

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Run the model once per batch size so the first requests are not slow."""
        ...

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Compute `output_names` from `inputs` (batch axis 0).

        BYTES tensors are object arrays of ``bytes`` both ways (inputs may
        also hold ``str``); an engine whose library wants another form
        converts inside `run`.

        Raises:
            EngineInputError: the engine refused these inputs, or failed on
                them through their fault (a string that does not parse).
            PermanentEngineError: it failed on them in a way that will recur,
                not through their fault (a broken model): retrying cannot help.
            EngineError: the engine failed otherwise (a retry may pass).
        """
        ...

    def close(self) -> None:
        """Release the model and its memory; `run` must not be called after."""
        ...


def warmup_batch_sizes(config: ModelConfig) -> list[int]:
    """Batch sizes to warm up: 1, the preferred sizes and the maximum."""
    if config.max_batch_size <= 0:
        return [0]
    sizes = {1, config.max_batch_size, *config.batching.preferred_batch_sizes}
    return sorted(s for s in sizes if 1 <= s <= config.max_batch_size)
