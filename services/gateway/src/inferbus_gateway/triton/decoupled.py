"""Decoupled tensor models: one computed answer split into 0..n responses.

Triton's decoupled models send any number of responses per request from
their backend. An ONNX graph computes once, so a decoupled inferbus model
(``config.json`` ``decoupled``) computes every response in one run and gives
each output a *responses axis*; the gateway splits the answer along it, and
the ModelStreamInfer handler streams the pieces, each with
``triton_final_response: false``, then (when the client asked with
``triton_enable_empty_final_response``) an empty final response, as Triton
does for a backend that sends its final flag apart. Workers, batchers and the
bus see an ordinary request and answer. Design: docs/architecture.md
("Streaming and decoupled models").
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from inferbus_common.codec import tensor_from_numpy
from inferbus_common.errors import Internal
from inferbus_common.modelconfig import DecoupledConfig
from inferbus_gateway.canonical import InferResponse


def split_responses(decoupled: DecoupledConfig, response: InferResponse) -> list[InferResponse]:
    """The responses one computed answer holds, in order (possibly none).

    Response i carries index i along ``decoupled.axis`` of every output (kept
    as an axis of length 1 when ``keep_axis``).

    Raises:
        Internal: an output lacks the axis, or the outputs disagree on its length
            (the model does not keep its decoupled contract).
    """
    axis = decoupled.axis
    arrays = {}
    count: int | None = None
    for t in response.outputs:
        arr = t.as_numpy()
        if axis >= arr.ndim:
            raise Internal(
                f"model '{response.model}' gave output '{t.name}' of shape {list(arr.shape)}, "
                f"which has no responses axis {axis} (decoupled.axis)"
            )
        if count is not None and arr.shape[axis] != count:
            raise Internal(
                f"model '{response.model}' gave outputs of different lengths along its "
                f"responses axis {axis} ({count} and {arr.shape[axis]} for '{t.name}')"
            )
        count = arr.shape[axis]
        arrays[t.name] = arr
    out = []
    for i in range(count or 0):
        index = [i] if decoupled.keep_axis else i
        tensors = [
            tensor_from_numpy(name, np.ascontiguousarray(np.take(arr, index, axis=axis)))
            for name, arr in arrays.items()
        ]
        out.append(replace(response, outputs=tensors, shm_outputs={}))
    return out
