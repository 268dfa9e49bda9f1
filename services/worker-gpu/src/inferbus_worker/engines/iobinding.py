"""Feeding an ONNX Runtime CUDA session through IO binding (GPU only).

``session.run`` with numpy arrays allocates device memory for every input
and output on every run and copies through ONNX Runtime's staging. Here
each input shape gets device buffers once (`OrtValue` on ``cuda``), the
batch's numpy view is copied into them (one host → device copy), outputs
whose shape the model fixes apart from the batch axis are bound to device
buffers allocated once per shape, and `copy_outputs_to_cpu` brings them
back (one device → host copy).

With ``enable_cuda_graph`` the session replays a captured CUDA graph instead
of launching kernels one by one. A graph reads and writes fixed addresses,
so each graph (``gpu_graph_id``) belongs to one shape: batches are padded
with zero rows up to the next of the version's batch sizes (the warm-up
sizes: 1, the preferred sizes, the maximum), captured once each, and the
padding rows are cut from the outputs. Shapes outside those sizes run
without a graph (``gpu_graph_id`` -1). Graph replays of one session
cannot overlap (their buffers are shared), so runs of a graph session take
a lock: concurrency then comes from an instance group (one session each).

Pinned host buffers are not used: ONNX Runtime's Python API allocates
pinned memory only through plugin execution providers' memory infos, which
the CUDA provider of 1.31 does not offer; the driver stages the one copy
from pageable memory.

Nothing here runs on a CPU-only machine: `OnnxRuntimeEngine` uses it only
when the session's first provider is ``CUDAExecutionProvider``; its tests
are marked ``gpu``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferbus_worker.engines.base import EngineError

_MAX_SHAPES = 64
"""Input shapes whose buffers a thread keeps (without graphs the oldest go first; with
graphs, shapes beyond it run without a graph)."""


@dataclass(slots=True)
class _Bound:
    """One input shape's binding: device buffers in, device buffers (or ORT's) out."""

    binding: Any
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    graph_id: int = -1


class CudaBinding:
    """Runs a CUDA session through IO binding (see module docstring).

    Args:
        session: the loaded ``InferenceSession`` (first provider CUDA).
        device_id: the CUDA device of the session.
        dtypes: numpy dtype of each input and output, by name.
        batched: the model's axis 0 is the batch axis.
        cuda_graph: the session was opened with ``enable_cuda_graph``.
        batch_sizes: the sizes graphs are captured for (batches are padded up to them).
        device: where the buffers live: ``cuda``; ``cpu`` runs the same binding
            logic on a CPU session (how machines without a GPU test it).
    """

    def __init__(
        self,
        session: Any,
        device_id: int,
        *,
        dtypes: Mapping[str, Any],
        batched: bool,
        cuda_graph: bool = False,
        batch_sizes: Sequence[int] = (),
        device: str = "cuda",
    ) -> None:
        import onnxruntime as ort

        self._ort = ort
        self._session = session
        self._device = device_id
        self._kind = device
        self._dtypes = dict(dtypes)
        self._graph = cuda_graph
        self._batched = batched
        self._buckets = sorted({b for b in batch_sizes if b > 0})
        self._out_shapes = {m.name: list(m.shape) for m in session.get_outputs()}
        self._local = threading.local()
        self._shared: dict[Any, _Bound] = {}
        self._graph_lock = threading.Lock()
        self._next_graph = 0

    @property
    def description(self) -> str:
        """``io-binding`` (``+cuda-graphs`` with graphs)."""
        return "io-binding+cuda-graphs" if self._graph else "io-binding"

    def _padded_rows(self, rows: int) -> int:
        """The batch size a graph run of `rows` rows uses (`rows` when none fits)."""
        i = bisect.bisect_left(self._buckets, rows)
        return self._buckets[i] if i < len(self._buckets) else rows

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        """Copy `feeds` in, run, copy `output_names` out (padding rows removed)."""
        arrays = {name: np.ascontiguousarray(arr) for name, arr in feeds.items()}
        rows = next(iter(arrays.values())).shape[0] if self._batched and arrays else 0
        padded = self._padded_rows(rows) if self._graph and rows else rows
        if padded != rows:
            arrays = {name: _pad(arr, padded) for name, arr in arrays.items()}
        key = (
            tuple((name, arr.shape) for name, arr in sorted(arrays.items())),
            tuple(output_names),
        )
        if self._graph:
            with self._graph_lock:
                bound = self._shared.get(key)
                if bound is None and len(self._shared) >= _MAX_SHAPES:
                    # Captured graphs pin their buffers: past the bound, shapes run
                    # without a graph on buffers of their own, not kept.
                    bound = self._bind(arrays, output_names, graph=False)
                elif bound is None:
                    graph = padded in self._buckets or not self._buckets
                    bound = self._bind(arrays, output_names, graph=graph)
                    self._shared[key] = bound
                results = self._run(bound, arrays)
        else:
            cache: dict[Any, _Bound] = getattr(self._local, "cache", None) or {}
            self._local.cache = cache
            bound = cache.pop(key, None) or self._bind(arrays, output_names, graph=False)
            cache[key] = bound  # most recently used last
            while len(cache) > _MAX_SHAPES:
                cache.pop(next(iter(cache)))
            results = self._run(bound, arrays)
        out = dict(zip(output_names, results, strict=True))
        if padded != rows:
            out = {name: value[:rows] for name, value in out.items()}
        return out

    def _bind(
        self, arrays: Mapping[str, np.ndarray], output_names: Sequence[str], *, graph: bool
    ) -> _Bound:
        ort = self._ort
        bound = _Bound(binding=self._session.io_binding(), outputs=list(output_names))
        for name, arr in arrays.items():
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                list(arr.shape), arr.dtype.type, self._kind, self._device
            )
            bound.inputs[name] = value
            bound.binding.bind_ortvalue_input(name, value)
        rows = next(iter(arrays.values())).shape[0] if self._batched and arrays else None
        for name in output_names:
            shape = _static_shape(self._out_shapes[name], rows)
            if shape is None and graph:
                raise EngineError(
                    f"enable_cuda_graph: output '{name}' has a shape the model does not fix "
                    f"({self._out_shapes[name]}); a CUDA graph writes to fixed buffers"
                )
            if shape is None:
                # Shape known only after the run: ONNX Runtime allocates it on the device.
                bound.binding.bind_output(name, self._kind, self._device)
                continue
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, self._dtypes[name], self._kind, self._device
            )
            bound.binding.bind_ortvalue_output(name, value)
        if graph:
            bound.graph_id = self._next_graph
            self._next_graph += 1
        return bound

    def _run(self, bound: _Bound, arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        for name, arr in arrays.items():
            bound.inputs[name].update_inplace(arr)  # the one copy in
        options = None
        if self._graph:
            options = self._ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(bound.graph_id))
        self._session.run_with_iobinding(bound.binding, options)
        return list(bound.binding.copy_outputs_to_cpu())  # the one copy out

    def close(self) -> None:
        """Drop every binding and device buffer."""
        self._shared.clear()
        self._local = threading.local()


def _static_shape(dims: Sequence[Any], rows: int | None) -> list[int] | None:
    """An output's shape when the model fixes it (the batch axis from the input)."""
    shape: list[int] = []
    for i, dim in enumerate(dims):
        if isinstance(dim, int) and dim > 0:
            shape.append(dim)
        elif i == 0 and rows is not None:
            shape.append(rows)
        else:
            return None
    return shape


def _pad(arr: np.ndarray, rows: int) -> np.ndarray:
    """`arr` with zero rows appended up to `rows` rows."""
    out = np.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out
