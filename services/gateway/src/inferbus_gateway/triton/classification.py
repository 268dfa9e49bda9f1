"""Triton's classification extension: the top classes of an output instead of its tensor.

A client asks for it per requested output (REST ``outputs[i].parameters.
classification``, gRPC ``parameters["classification"]``; `tritonclient`'s
``InferRequestedOutput(name, class_count=k)``). The answer replaces that
output with a BYTES tensor of the ``k`` largest values of each batch row,
best first, each ``"<value>:<index>"`` or, when the output's config names a
``label_filename``, ``"<value>:<index>:<label>"`` (line ``index`` of the
labels file). Shape ``[batch, k]`` for a batched model, ``[k]`` otherwise.

The models compute as usual; the gateway applies this to the answer, so the
workers, the bus formats and the batcher stay unaware of it. Labels files
are read from the registry once per version file (cached by its SHA-256).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from inferbus_common.catalog import Catalog, DeployedVersion
from inferbus_common.codec import Tensor, tensor_from_numpy
from inferbus_common.datatypes import BYTES
from inferbus_common.errors import FailedPrecondition, InvalidArgument
from inferbus_gateway.canonical import InferRequest, InferResponse

ReadFile = Callable[[str, str, str], Awaitable[bytes]]
"""(model, version, path) → the file's bytes, from the registry."""

_MAX_CACHED = 256


def parse_labels(data: bytes, name: str) -> list[str]:
    """Line i of a labels file names class i (trailing blank lines ignored).

    Raises:
        FailedPrecondition: the file is not UTF-8 text.
    """
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise FailedPrecondition(f"labels file {name!r} is not UTF-8 text: {exc}") from None
    while lines and not lines[-1].strip():
        lines.pop()
    return [line.strip() for line in lines]


def classify(tensor: Tensor, k: int, labels: list[str] | None, *, batched: bool) -> Tensor:
    """The classification answer for one output tensor (see module docstring).

    Raises:
        InvalidArgument: the output is not numeric.
    """
    if tensor.datatype in (BYTES, "BOOL"):
        raise InvalidArgument(
            f"output '{tensor.name}' is {tensor.datatype}: classification needs a numeric output"
        )
    values = tensor.as_numpy()
    rows = values.reshape(values.shape[0] if batched and values.ndim else 1, -1)
    k = min(k, rows.shape[1])
    # Stable sort of the negated values: ties keep the lower class index first.
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    floating = values.dtype.kind == "f"
    out: np.ndarray[Any, np.dtype[Any]] = np.empty(order.shape, dtype=object)
    for r in range(order.shape[0]):
        for c in range(k):
            i = int(order[r, c])
            v = rows[r, i]
            text = f"{float(v):f}:{i}" if floating else f"{int(v)}:{i}"
            if labels is not None and i < len(labels):
                text = f"{text}:{labels[i]}"
            out[r, c] = text.encode("utf-8")
    if not batched:
        out = out.reshape(k)
    return tensor_from_numpy(tensor.name, out)


class Classifier:
    """Applies the classification extension to answers, with each version's labels.

    Args:
        catalog: the gateway's catalog (configs and file digests of versions).
        read_file: reads a version's file from the registry.
    """

    def __init__(self, catalog: Catalog, read_file: ReadFile) -> None:
        self._catalog = catalog
        self._read_file = read_file
        self._labels: dict[tuple[str, str, str, str], list[str]] = {}

    async def _labels_of(self, dv: DeployedVersion, path: str) -> list[str]:
        key = (dv.model, dv.version, path, dv.files.get(path, ""))
        labels = self._labels.get(key)
        if labels is None:
            labels = parse_labels(await self._read_file(dv.model, dv.version, path), path)
            if len(self._labels) >= _MAX_CACHED:
                self._labels.clear()
            self._labels[key] = labels
        return labels

    async def apply(self, request: InferRequest, response: InferResponse) -> None:
        """Replace the outputs the request asked classification of (in place).

        Raises:
            InvalidArgument: an output that is not numeric.
            Unavailable: the registry could not deliver a labels file.
        """
        if not request.classification:
            return
        dv = self._catalog.versions.get((request.model, response.version))
        config = dv.config if dv is not None else None
        batched = config.max_batch_size > 0 if config is not None else True
        specs = {s.name: s for s in config.outputs} if config is not None else {}
        for i, tensor in enumerate(response.outputs):
            k = request.classification.get(tensor.name)
            if k is None:
                continue
            spec = specs.get(tensor.name)
            labels = None
            if dv is not None and spec is not None and spec.label_filename:
                labels = await self._labels_of(dv, spec.label_filename)
            response.outputs[i] = classify(tensor, k, labels, batched=batched)


def class_count(value: object, output: str) -> int:
    """A ``classification`` parameter's value: a positive integer.

    Raises:
        InvalidArgument: anything else.
    """
    if type(value) is not int or value < 1:
        raise InvalidArgument(
            f"output '{output}': parameters.classification must be a positive integer "
            f"(the number of classes), got {value!r}"
        )
    return value
