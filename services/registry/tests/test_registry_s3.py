"""The registry on a real S3 server (SeaweedFS, signature-checked): push, get, download, restart."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from pathlib import Path

import nats

from inferbus_client.registry import RegistryClient
from inferbus_common.catalog import Catalog
from inferbus_common.subjects import Subjects
from inferbus_registry.app import RegistryApp
from inferbus_registry.store import S3Store
from inferbus_testing.servers import S3Server


async def test_s3_round_trip_and_restart(
    start_registry: Callable[..., RegistryApp],
    s3_server: S3Server,
    make_version: Callable[..., Path],
    tmp_path: Path,
) -> None:
    bucket = "ib-reg-" + secrets.token_hex(4)
    s3 = {
        "store": "s3",
        "s3_endpoint": s3_server.endpoint,
        "s3_access_key": s3_server.access_key,
        "s3_secret_key": s3_server.secret_key,
        "s3_bucket": bucket,
    }
    src = make_version()
    async with start_registry(**s3) as app:
        assert isinstance(app.store, S3Store)
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as client:
            info = await client.push(src, "fraud", "1.0.0", aliases=["canary"])
            again = await client.push(src, "fraud", "1.0.0")
            assert again.digest == info.digest
            dest = await client.download("fraud", "canary", "model.onnx", tmp_path / "m.onnx")
            assert dest.read_bytes() == (src / "model.onnx").read_bytes()
            got = await client.get_version("fraud")
            assert got.digest == info.digest == hashlib.sha256(got.manifest_json).hexdigest()
        settings = app.settings

    # The objects really are in the bucket, in the documented layout.
    names = sorted(
        o.object_name
        for o in s3_server.client().list_objects(bucket, recursive=True)  # type: ignore[attr-defined]
    )
    assert names == [
        "models/fraud/1.0.0/config.json",
        "models/fraud/1.0.0/manifest.json",
        "models/fraud/1.0.0/model.onnx",
        "models/fraud/aliases.json",
        "models/fraud/numbers.json",
    ]

    # A fresh catalog is rebuilt from S3 on start-up.
    subjects = Subjects(settings.subject_prefix)
    conn = await nats.connect(settings.nats_url)
    try:
        js = conn.jetstream()
        await js.delete_key_value(subjects.models_bucket)
        await js.delete_key_value(subjects.routes_bucket)
        async with start_registry(**s3), Catalog(js, subjects) as catalog:
            await catalog.wait_loaded()
            assert await catalog.wait_for(lambda: "fraud" in catalog.routes, timeout=5)
            dv = catalog.resolve("fraud", "canary")
            assert dv is not None and dv.digest == info.digest
    finally:
        await conn.close()
