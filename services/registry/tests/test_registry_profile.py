"""A version's profile.json: stored, listed, published to the profiles bucket, republished."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import nats
import numpy as np
import pytest

from inferbus_client.registry import RegistryClient
from inferbus_common.catalog import Catalog
from inferbus_common.drift import build_profile, parse_profile
from inferbus_common.errors import InvalidArgument
from inferbus_common.subjects import Subjects
from inferbus_registry.app import RegistryApp


def _with_profile(version_dir: Path, tensor: str = "x") -> Path:
    rng = np.random.default_rng(0)
    profile = build_profile({tensor: rng.normal(size=(200, 64))}, model="fraud")
    (version_dir / "profile.json").write_text(profile.model_dump_json())
    return version_dir


async def test_profile_is_published_and_republished(
    start_registry: Callable[..., RegistryApp], make_version: Callable[..., Path]
) -> None:
    async with start_registry() as app:
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as c:
            info = await c.push(_with_profile(make_version()), "fraud", "1")
            await c.push(make_version(), "fraud", "2")
            assert "profile.json" in [f.path for f in info.files]
            with pytest.raises(InvalidArgument, match="does not have"):
                await c.push(_with_profile(make_version(), "nope"), "fraud", "3")
        settings = app.settings
    subjects = Subjects(settings.subject_prefix)
    conn = await nats.connect(settings.nats_url)
    try:
        js = conn.jetstream()
        kv = await js.key_value(subjects.profiles_bucket)
        profile = parse_profile((await kv.get("fraud.1")).value or b"")
        assert len(profile.features) == 64 and profile.features[0].name == "x[0]"
        # A NATS that lost its state gets the profile back with the catalog.
        await js.delete_key_value(subjects.profiles_bucket)
        await js.delete_key_value(subjects.models_bucket)
        async with start_registry():
            async with Catalog(js, subjects) as catalog:
                await catalog.wait_loaded()
                assert await catalog.wait_for(lambda: len(catalog.versions) == 2, timeout=5)
                assert catalog.versions[("fraud", "1")].has_profile
                assert not catalog.versions[("fraud", "2")].has_profile
            kv = await js.key_value(subjects.profiles_bucket)
            assert parse_profile((await kv.get("fraud.1")).value or b"") == profile
    finally:
        await conn.close()
