"""Checking a pushed ``profile.json`` (a version's drift reference) against its config.

A version may carry a reference profile of its inputs and outputs (built by
``inferbus profile``, format in `inferbus_common.drift`). The registry refuses
a push whose profile does not parse or describes tensors or columns the model
does not have: a profile that can never match live traffic would only yield
misleading drift numbers later.
"""

from __future__ import annotations

import math
from pathlib import Path

from inferbus_common.drift import PROFILE_FILE, parse_profile
from inferbus_common.errors import InvalidArgument
from inferbus_common.modelconfig import ModelConfig

__all__ = ["PROFILE_FILE", "check_profile"]

MAX_PROFILE_BYTES = 512 * 1024
"""A profile is published as a NATS KV value: it must stay well under NATS's 1 MiB payload."""


def check_profile(path: Path, config: ModelConfig, model: str) -> None:
    """Validate a pushed profile.

    Raises:
        InvalidArgument: the profile is too large, malformed, or names a tensor
            or column the model's config does not have.
    """
    size = path.stat().st_size
    if size > MAX_PROFILE_BYTES:
        raise InvalidArgument(
            f"{model}: {PROFILE_FILE} is {size} bytes; at most {MAX_PROFILE_BYTES} are "
            "accepted (profile fewer features or use fewer bins)"
        )
    try:
        profile = parse_profile(path.read_bytes())
    except ValueError as exc:
        raise InvalidArgument(f"{model}: {exc}") from None
    specs = {s.name: s for s in [*config.inputs, *config.outputs]}
    for feature in profile.features:
        spec = specs.get(feature.tensor)
        if spec is None:
            raise InvalidArgument(
                f"{model}: {PROFILE_FILE} feature {feature.name!r} is about tensor "
                f"{feature.tensor!r}, which the model does not have (tensors: {sorted(specs)})"
            )
        # Rows are the first axis (the batch axis when batching is on).
        dims = spec.shape[1:]
        if all(d > 0 for d in dims):
            width = math.prod(dims) if dims else 1
            if feature.index >= width:
                raise InvalidArgument(
                    f"{model}: {PROFILE_FILE} feature {feature.name!r} is column "
                    f"{feature.index} of {feature.tensor!r}, which has {width} per row"
                )
