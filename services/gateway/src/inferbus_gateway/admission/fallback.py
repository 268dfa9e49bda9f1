"""Degraded answers from a model's ``fallback`` config (fixed output values).

When a model cannot answer (its breaker is open, it is overloaded or down) and
its ``config.json`` has ``fallback.outputs``, the gateway may answer with those
fixed values instead of an error, and must mark the answer as a fallback
(`FALLBACK_HEADER`) so clients can tell it from a prediction. A
``fallback.model`` (backup model) is a routing decision for the gateway's
inference path, not built here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferbus_common.codec import Tensor, serialize_bytes
from inferbus_common.datatypes import BYTES, numpy_dtype
from inferbus_common.modelconfig import ModelConfig
from inferbus_common.tensorspec import TensorSpec

FALLBACK_HEADER = "inferbus-fallback"
"""Response header (HTTP) / trailing metadata (gRPC) set to the reason on fallback answers."""


def _row_shape(spec: TensorSpec, batched: bool, count: int) -> tuple[int, ...] | None:
    dims = list(spec.shape[1:] if batched else spec.shape)
    unknown = [i for i, d in enumerate(dims) if d == -1]
    known = int(np.prod([d for d in dims if d != -1])) if dims else 1
    if len(unknown) > 1:
        return None
    if unknown:
        if known == 0 or count % known:
            return None
        dims[unknown[0]] = count // known
    elif known != count:
        return None
    return tuple(dims)


def fallback_outputs(
    config: ModelConfig, batch_size: int, requested: Sequence[str] = ()
) -> list[Tensor] | None:
    """The fixed fallback answer for a request of `batch_size` rows.

    Args:
        config: the model version's config.
        batch_size: rows in the request (ignored when ``max_batch_size == 0``).
        requested: output names the client asked for (empty: every output).

    Returns:
        One tensor per output answered, or None when the model has no fixed
        fallback or it does not cover every output asked for (then the original
        error should be returned).
    """
    fb = config.fallback
    if fb is None or fb.outputs is None:
        return None
    wanted = list(requested) or [s.name for s in config.outputs]
    if any(name not in fb.outputs for name in wanted):
        return None
    batched = config.max_batch_size > 0
    out: list[Tensor] = []
    for spec in config.outputs:
        if spec.name not in wanted:
            continue
        values = fb.outputs[spec.name]
        row = _row_shape(spec, batched, len(values))
        if row is None:
            return None
        shape = (batch_size, *row) if batched else row
        if spec.datatype == BYTES:
            flat = [v for _ in range(batch_size if batched else 1) for v in values]
            out.append(Tensor(spec.name, BYTES, shape, serialize_bytes(flat)))
            continue
        one = np.asarray(values, dtype=numpy_dtype(spec.datatype)).reshape(row)
        full = np.broadcast_to(one, shape) if batched else one
        out.append(Tensor(spec.name, spec.datatype, shape, np.ascontiguousarray(full).tobytes()))
    return out
