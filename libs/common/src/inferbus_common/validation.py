"""`ModelConfig.validate_request` for the hot path, remembering layouts that passed.

A request of fixed-size tensors passes or fails validation depending only on
its tensors' names, datatypes, shapes and byte sizes (and the outputs it
asks for), never on the bytes themselves. Under load nearly every request of
a model version has one of a few such layouts, so `RequestChecker` keeps the
layouts that passed and skips the full check for them. Anything else (a new
layout, a BYTES tensor, whose check reads the data and may truncate it in
place) goes through `ModelConfig.validate_request`, so errors and their
messages are the same as calling it directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferbus_common.codec import Tensor
from inferbus_common.datatypes import BYTES
from inferbus_common.modelconfig import ModelConfig

_MAX_LAYOUTS = 256


class RequestChecker:
    """Validates requests against one config; layouts that passed are checked once.

    Bound to one `ModelConfig` object: a re-published config needs a new
    checker (the config is not copied; it must not be changed in place).

    Args:
        config: the model version's config.
        max_layouts: most layouts remembered (beyond it, new ones are always
            checked in full).
    """

    __slots__ = ("_config", "_max", "_passed")

    def __init__(self, config: ModelConfig, *, max_layouts: int = _MAX_LAYOUTS) -> None:
        self._config = config
        self._max = max_layouts
        self._passed: set[tuple[object, ...]] = set()

    @property
    def config(self) -> ModelConfig:
        """The config requests are checked against."""
        return self._config

    def check(
        self, tensors: Sequence[Tensor], outputs: Sequence[str] = (), *, trusted: bool = False
    ) -> None:
        """`ModelConfig.validate_request`, skipped for a layout that passed before.

        `trusted`: the tensors were validated in full upstream (by a gateway;
        only producers the broker allows publish here), so a BYTES tensor's
        layout (name, shape) that passed before is not read element by element
        again: a structural check.

        Raises:
            InvalidArgument: as `ModelConfig.validate_request` does.
        """
        # No key (checked in full every time) when an untrusted BYTES tensor is present.
        key: tuple[object, ...] | None = None
        parts: list[object] = [tuple(outputs)]
        for t in tensors:
            if t.datatype == BYTES:
                if not trusted:
                    break
                parts.append((t.name, BYTES, tuple(t.shape)))
                continue
            parts.append((t.name, t.datatype, tuple(t.shape), memoryview(t.data).nbytes))
        else:
            key = tuple(parts)
        if key is not None and key in self._passed:
            return
        self._config.validate_request(tensors, outputs)
        if key is not None and len(self._passed) < self._max:
            self._passed.add(key)
