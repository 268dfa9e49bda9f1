"""One input or output of a model (`TensorSpec`), as `config.json` declares it.

Shared by the model's client tensors, the engine tensors of `processing` and
the control and state tensors of `sequence_batching` (`inferbus_common.modelconfig`).
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from inferbus_common.datatypes import ALL_DATATYPES
from inferbus_common.imageformat import Format


class TensorSpec(BaseModel):
    """One input or output of a model. ``-1`` in `shape` means any size."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    datatype: str
    shape: list[int]
    max_element_bytes: int | None = Field(default=None, ge=1)
    """BYTES inputs only: the longest element accepted (e.g. text length)."""
    truncate: bool = False
    """BYTES inputs only: cut longer elements to `max_element_bytes` instead of
    refusing the request (a cleaning rule, like truncating over-long text)."""
    label_filename: str | None = None
    """Outputs only: labels file in the version directory (line i names class i),
    used by Triton's classification extension (``class_count`` on a requested
    output answers "score:index:label" strings of the top classes)."""
    format: Format | None = None
    """Inputs only: image layout (``FORMAT_NCHW``, ``FORMAT_NHWC``, ``FORMAT_NONE``),
    reported in Triton's model configuration; filled in at push where the shape
    makes it clear (`inferbus_common.imageformat`)."""

    @model_serializer(mode="wrap")
    def _omit_absent_labels(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out when unset, so configs without them dump (and hash) as before they existed.
        data: dict[str, Any] = handler(self)
        for key in ("label_filename", "format"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, v: str) -> str:
        if v not in ALL_DATATYPES:
            raise ValueError(f"unknown datatype {v!r}; expected one of {sorted(ALL_DATATYPES)}")
        return v

    @field_validator("label_filename")
    @classmethod
    def _relative_file(cls, v: str | None) -> str | None:
        if v is not None and (not v or v.startswith("/") or ".." in v.split("/")):
            raise ValueError(f"label_filename {v!r} must be a path inside the version directory")
        return v

    @model_validator(mode="after")
    def _bytes_rules(self) -> TensorSpec:
        if (self.max_element_bytes is not None or self.truncate) and self.datatype != "BYTES":
            raise ValueError(f"'{self.name}': max_element_bytes/truncate apply to BYTES only")
        if self.truncate and self.max_element_bytes is None:
            raise ValueError(f"'{self.name}': truncate needs max_element_bytes")
        return self

    @field_validator("shape")
    @classmethod
    def _dims(cls, v: list[int]) -> list[int]:
        if any(d < -1 or d == 0 for d in v):
            raise ValueError(f"shape {v}: dimensions must be positive or -1")
        return v
