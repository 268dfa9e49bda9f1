"""An instance group: N engine instances of one version, each with its own session.

Triton's ``instance_group``: where one session shared by several threads
serialises on one CUDA stream (or contends for one thread pool), separate
sessions run side by side (each its own stream and memory arena on a GPU,
its own threads on the CPU). `EngineInstances` is itself an `Engine`: the
runner keeps up to ``instance_count`` micro-batches in flight (one per
execution slot, `ModelRunner`), and each `run` takes a free instance for
its duration, so N batches compute at once on N sessions.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence

import numpy as np

from inferbus_common.engineconfig import DeviceKind
from inferbus_worker.engines.base import Engine, EngineError


class EngineInstances:
    """Several instances of one version's engine behind the `Engine` contract.

    Args:
        instances: the engines, not loaded yet (built with their own device).
        runs_each: concurrent runs each engine takes (a TensorRT engine with
            ``count`` execution contexts of its own takes ``count``).
    """

    def __init__(self, instances: Sequence[Engine], *, runs_each: int = 1) -> None:
        if not instances:
            raise ValueError("an instance group needs at least one instance")
        self._instances = list(instances)
        self._runs_each = runs_each
        self._free: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        self._loaded = False

    @property
    def instances(self) -> list[Engine]:
        """The instances, in the order they were placed."""
        return list(self._instances)

    @property
    def description(self) -> str:
        """``<count> x <first instance's description>``."""
        first = self._instances[0].description
        return f"{len(self._instances)} x {first}"

    @property
    def device_kind(self) -> DeviceKind:
        """Where the instances compute (``gpu`` only when all of them do)."""
        kinds = {e.device_kind for e in self._instances}
        return "gpu" if kinds == {"gpu"} else "cpu"

    def load(self) -> None:
        """Load every instance (a failure closes the ones already loaded)."""
        loaded: list[Engine] = []
        try:
            for engine in self._instances:
                engine.load()
                loaded.append(engine)
        except BaseException:
            for engine in loaded:
                engine.close()
            raise
        for _ in range(self._runs_each):
            for engine in self._instances:
                self._free.put(engine)
        self._loaded = True

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Warm every instance up (each has its own kernels, arenas and graphs)."""
        for engine in self._instances:
            engine.warmup(batch_sizes)

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Run on a free instance; see `Engine.run`.

        The runner never has more executions in flight than instances
        (``instance_count`` slots), so a free instance is there at once.
        """
        if not self._loaded:
            raise EngineError("engine is not loaded")
        engine = self._free.get()
        try:
            return engine.run(inputs, output_names)
        finally:
            self._free.put(engine)

    def close(self) -> None:
        """Close every instance."""
        self._loaded = False
        for engine in self._instances:
            engine.close()
