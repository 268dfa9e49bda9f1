"""Triton-style version numbers on a real registry (real NATS, local store).

Each version gets a number at push, written in its manifest and carried in
the catalog record; the number names the version wherever a version is
accepted (`inferbus_common.versionnumbers`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import nats
import pytest

from inferbus_client.registry import RegistryClient
from inferbus_common.catalog import parse_deployed_version
from inferbus_common.errors import FailedPrecondition, NotFound
from inferbus_registry.app import RegistryApp


async def test_versions_are_numbered_at_push_and_named_by_their_number(
    client: RegistryClient, registry: RegistryApp, make_version: Callable[..., Path]
) -> None:
    pushed = {}
    for i, version in enumerate(["1.0.0", "1.5.0", "5", "2.0.0"]):
        info = await client.push(make_version(seed=0.1 * (i + 1)), "fraud", version)
        pushed[version] = json.loads(info.manifest_json)["number"]
    # Semantic versions count up from the highest number; an integer keeps its own.
    assert pushed == {"1.0.0": 1, "1.5.0": 2, "5": 5, "2.0.0": 6}

    # A re-push of the same content keeps its number.
    again = await client.push(make_version(seed=0.2), "fraud", "1.5.0")
    assert json.loads(again.manifest_json)["number"] == 2
    # An integer version whose integer another version has as its number is refused.
    with pytest.raises(FailedPrecondition, match=r"number 2 .* '1\.5\.0' already has it"):
        await client.push(make_version(seed=0.9), "fraud", "2")

    # The number names the version wherever a version is accepted.
    assert (await client.get_version("fraud", "2")).version == "1.5.0"
    assert (await client.get_version("fraud", "6")).version == "2.0.0"
    assert (await client.get_version("fraud", "5")).version == "5"

    (model,) = await client.list_models()
    assert dict(model.numbers) == pushed

    # The catalog record the gateways read carries the number.
    nc = await nats.connect(registry.settings.nats_url)
    try:
        kv = await nc.jetstream().key_value(registry.subjects.models_bucket)
        entry = await kv.get(registry.subjects.model_key("fraud", "1.5.0"))
        assert entry.value is not None
        assert parse_deployed_version(entry.value).number == 2
    finally:
        await nc.close()


async def test_a_deleted_versions_number_never_names_another_version(
    client: RegistryClient, make_version: Callable[..., Path]
) -> None:
    await client.push(make_version(seed=0.1), "fraud", "1.0.0", aliases=["stable"])
    await client.push(make_version(seed=0.2), "fraud", "1.1.0")
    await client.delete_version("fraud", "1.1.0")
    info = await client.push(make_version(seed=0.3), "fraud", "1.2.0")
    assert json.loads(info.manifest_json)["number"] == 3
    with pytest.raises(NotFound):
        await client.get_version("fraud", "2")
