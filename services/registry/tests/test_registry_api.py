"""The registry's gRPC API end to end: a real registry, real NATS, a local store."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import httpx
import nats
import pytest
from nats.aio.client import Client

from inferbus_client.registry import RegistryClient
from inferbus_common.catalog import Catalog, DeployedVersion, Route
from inferbus_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from inferbus_common.subjects import Subjects
from inferbus_proto.registry import registry_pb2, registry_pb2_grpc
from inferbus_registry.app import RegistryApp
from inferbus_testing.servers import NatsServer

_FRAUD_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "fraud" / "make_model.py"


@pytest.fixture
async def nc(registry: RegistryApp) -> AsyncIterator[Client]:
    conn = await nats.connect(registry.settings.nats_url)
    try:
        yield conn
    finally:
        await conn.close()


async def _kv_json(nc: Client, bucket: str, key: str) -> dict[str, object]:
    kv = await nc.jetstream().key_value(bucket)
    entry = await kv.get(key)
    assert entry.value is not None
    return json.loads(entry.value)


async def test_push_get_list_download(
    client: RegistryClient,
    registry: RegistryApp,
    nc: Client,
    make_version: Callable[..., Path],
    tmp_path: Path,
) -> None:
    subjects = registry.subjects
    events = await nc.subscribe(subjects.events("fraud"))
    src = make_version()

    info = await client.push(src, "fraud", "1.0.0")

    model_bytes = (src / "model.onnx").read_bytes()
    files = {f.path: f for f in info.files}
    assert set(files) == {"model.onnx", "config.json"}
    assert files["model.onnx"].sha256 == hashlib.sha256(model_bytes).hexdigest()
    assert files["model.onnx"].size == len(model_bytes)
    assert info.digest == hashlib.sha256(info.manifest_json).hexdigest()
    manifest = json.loads(info.manifest_json)
    assert manifest["model"] == "fraud" and manifest["version"] == "1.0.0"
    assert manifest["signature"] is None
    assert manifest["files"]["model.onnx"]["sha256"] == files["model.onnx"].sha256
    assert json.loads(info.config_json)["name"] == "fraud"  # filled from the header
    assert sorted(info.aliases) == ["latest", "stable"]  # first version becomes stable

    # Catalog in KV: DeployedVersion and Route with the same digest.
    dv = DeployedVersion.model_validate(
        await _kv_json(nc, subjects.models_bucket, subjects.model_key("fraud", "1.0.0"))
    )
    assert dv.digest == info.digest
    assert dv.files["model.onnx"] == files["model.onnx"].sha256
    assert dv.config.inputs[0].shape == [-1, 64]
    route = Route.model_validate(
        await _kv_json(nc, subjects.routes_bucket, subjects.model_key("fraud"))
    )
    assert route.stable == "1.0.0" and route.versions == ["1.0.0"]
    assert route.aliases == {"latest": "1.0.0", "stable": "1.0.0"}

    event = json.loads((await events.next_msg(timeout=5)).data)
    assert event["event"] == "version_pushed" and event["version"] == "1.0.0"
    assert event["digest"] == info.digest

    models = await client.list_models()
    assert [(m.name, list(m.versions), dict(m.aliases)) for m in models] == [
        ("fraud", ["1.0.0"], {"latest": "1.0.0", "stable": "1.0.0"})
    ]
    for ref in ("", "stable", "latest", "1.0.0"):
        got = await client.get_version("fraud", ref)
        assert got.version == "1.0.0" and got.digest == info.digest

    dest = await client.download("fraud", "stable", "model.onnx", tmp_path / "dl" / "model.onnx")
    assert dest.read_bytes() == model_bytes
    cfg = await client.download("fraud", "1.0.0", "config.json", tmp_path / "dl" / "config.json")
    assert cfg.read_bytes() == info.config_json


async def test_versions_aliases_and_route(
    client: RegistryClient, registry: RegistryApp, nc: Client, make_version: Callable[..., Path]
) -> None:
    subjects = registry.subjects
    await client.push(make_version(), "fraud", "1.0.0")
    await client.push(make_version(seed=0.25), "fraud", "1.10.0")
    info = await client.push(make_version(seed=0.75), "fraud", "1.2.0", aliases=["canary"])
    assert info.aliases == ["canary"]

    route = Route.model_validate(
        await _kv_json(nc, subjects.routes_bucket, subjects.model_key("fraud"))
    )
    assert route.versions == ["1.0.0", "1.2.0", "1.10.0"]
    assert route.stable == "1.0.0"  # pushing never moves an existing stable unless asked
    assert route.aliases == {"stable": "1.0.0", "latest": "1.10.0", "canary": "1.2.0"}

    events = await nc.subscribe(subjects.events("fraud"))
    model = await client.set_alias("fraud", "stable", "1.2.0")
    assert dict(model.aliases)["stable"] == "1.2.0"
    event = json.loads((await events.next_msg(timeout=5)).data)
    assert event == {
        "event": "alias_set",
        "model": "fraud",
        "alias": "stable",
        "version": "1.2.0",
        "previous": "1.0.0",
        "aliases": {"canary": "1.2.0", "latest": "1.10.0", "stable": "1.2.0"},
    }
    route = Route.model_validate(
        await _kv_json(nc, subjects.routes_bucket, subjects.model_key("fraud"))
    )
    assert route.stable == "1.2.0" == route.aliases["stable"]
    assert (await client.get_version("fraud")).version == "1.2.0"

    # A new stable with another pool moves the route's pool.
    await client.push(
        make_version(config=_config(pool="gpu-a")), "fraud", "2.0.0-rc.1", aliases=["stable"]
    )
    route = Route.model_validate(
        await _kv_json(nc, subjects.routes_bucket, subjects.model_key("fraud"))
    )
    assert route.stable == "2.0.0-rc.1" and route.pool == "gpu-a"
    assert route.aliases["latest"] == "2.0.0-rc.1"


def _config(**overrides: object) -> dict[str, object]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        **overrides,
    }


async def test_repush_identical_is_ok_and_different_is_refused(
    client: RegistryClient, make_version: Callable[..., Path]
) -> None:
    src = make_version()
    first = await client.push(src, "fraud", "1")
    again = await client.push(src, "fraud", "1")
    assert again.digest == first.digest
    assert again.created_unix_ms == first.created_unix_ms

    with pytest.raises(
        FailedPrecondition, match=r"already exists with different content.*model\.onnx"
    ):
        await client.push(make_version(seed=0.9), "fraud", "1")
    with pytest.raises(FailedPrecondition, match=r"immutable"):
        await client.push(make_version(config=_config(max_batch_size=8)), "fraud", "1")
    assert (await client.get_version("fraud", "1")).digest == first.digest


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("not json", "config.json is not valid JSON"),
        ("[1, 2]", "config.json must be a JSON object"),
        (
            json.dumps({"inputs": [{"name": "x", "datatype": "FP33", "shape": [-1, 64]}]}),
            r"config.json is invalid: inputs.0.datatype: .*unknown datatype 'FP33'"
            r".*outputs: Field required",
        ),
        (
            json.dumps(_config(name="other")),
            "config.json names model 'other' but the push is for 'fraud'",
        ),
        (
            json.dumps(_config(file="weights.onnx")),
            r"names file 'weights.onnx' but the push sent \['model.onnx'\]",
        ),
        (
            json.dumps(_config(inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 32]}])),
            r"input 'x' dimension 1 is 32 in config.json but 64 in the ONNX model",
        ),
        (
            json.dumps(_config(outputs=[{"name": "prob", "datatype": "FP32", "shape": [-1, 2]}])),
            r"output 'prob' is not an output of the ONNX model; the model's outputs are \['y'\]",
        ),
    ],
)
async def test_bad_versions_are_invalid_argument(
    client: RegistryClient, make_version: Callable[..., Path], config: str, message: str
) -> None:
    src = make_version()
    (src / "config.json").write_text(config)
    with pytest.raises(InvalidArgument, match=message):
        await client.push(src, "fraud", "1.0.0")
    with pytest.raises(NotFound):
        await client.get_version("fraud", "1.0.0")
    assert await client.list_models() == []


@pytest.mark.parametrize(
    ("model", "version", "aliases", "message"),
    [
        ("fraud", "v1", [], "invalid version 'v1': expected a semantic version"),
        ("fraud", "../1", [], "invalid version"),
        ("../fraud", "1", [], "invalid model name"),
        ("a/b", "1", [], "invalid model name"),
        ("fraud", "1", ["latest"], "managed by the registry"),
        ("fraud", "1", ["1.0"], "invalid alias"),
    ],
)
async def test_bad_names_are_invalid_argument(
    client: RegistryClient,
    make_version: Callable[..., Path],
    model: str,
    version: str,
    aliases: list[str],
    message: str,
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        await client.push(make_version(), model, version, aliases)


async def _raw_push(port: int, messages: list[registry_pb2.PushChunk]) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PushVersion(iter(messages), timeout=10)
    return info.value


def _header(config: bytes) -> registry_pb2.PushChunk:
    return registry_pb2.PushChunk(
        header=registry_pb2.PushHeader(model="fraud", version="1", config_json=config)
    )


def _chunk(path: str, data: bytes) -> registry_pb2.PushChunk:
    return registry_pb2.PushChunk(chunk=registry_pb2.FileChunk(path=path, data=data))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../../etc/passwd", "invalid file path '../../etc/passwd'"),
        ("/abs/model.onnx", "invalid file path"),
        ("a/../model.onnx", "invalid file path"),
        ("manifest.json", "written by the registry"),
    ],
)
async def test_path_traversal_is_refused(
    registry: RegistryApp, make_version: Callable[..., Path], path: str, message: str
) -> None:
    src = make_version()
    err = await _raw_push(
        registry.grpc_port,
        [
            _header((src / "config.json").read_bytes()),
            _chunk("model.onnx", (src / "model.onnx").read_bytes()),
            _chunk(path, b"x"),
        ],
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.details() or "")
    store_root = registry.settings.store_dir
    assert not list(store_root.rglob("passwd"))
    assert not (store_root / "models" / "fraud").exists()


async def test_stream_must_start_with_one_header(
    registry: RegistryApp, make_version: Callable[..., Path]
) -> None:
    src = make_version()
    err = await _raw_push(registry.grpc_port, [_chunk("model.onnx", b"x")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first PushVersion message must be a header" in (err.details() or "")
    header = _header((src / "config.json").read_bytes())
    err = await _raw_push(registry.grpc_port, [header, header])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exactly one header" in (err.details() or "")


async def test_not_found(client: RegistryClient, make_version: Callable[..., Path]) -> None:
    with pytest.raises(NotFound, match="no model 'ghost'"):
        await client.get_version("ghost")
    await client.push(make_version(), "fraud", "1.0.0")
    with pytest.raises(NotFound, match=r"has no version '9\.9\.9'"):
        await client.get_version("fraud", "9.9.9")
    with pytest.raises(NotFound, match=r"has no alias 'canary'"):
        await client.get_version("fraud", "canary")
    with pytest.raises(NotFound, match=r"has no version '2\.0\.0'"):
        await client.set_alias("fraud", "canary", "2.0.0")
    with pytest.raises(NotFound, match=r"has no file 'weights\.bin'"):
        await client.download("fraud", "1.0.0", "weights.bin", Path("/nonexistent/never-written"))
    with pytest.raises(InvalidArgument, match="managed by the registry"):
        await client.set_alias("fraud", "latest", "1.0.0")


async def test_download_streams_1mib_chunks(
    registry: RegistryApp, client: RegistryClient, make_version: Callable[..., Path]
) -> None:
    # 600 x 1024 float32 weights: a ~2.4 MiB model, so several chunks.
    src = make_version(
        config=_config(
            inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 600]}],
            outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 1024]}],
        ),
        features=600,
        classes=1024,
    )
    await client.push(src, "big", "1")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{registry.grpc_port}") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        call = stub.DownloadFile(
            registry_pb2.DownloadFileRequest(model="big", version="1", path="model.onnx")
        )
        sizes = [len(chunk.data) async for chunk in call]
    assert len(sizes) >= 3 and max(sizes) == 1 << 20
    assert sum(sizes) == (src / "model.onnx").stat().st_size


async def test_restart_republishes_the_catalog(
    start_registry: Callable[..., RegistryApp],
    make_version: Callable[..., Path],
) -> None:
    async with start_registry() as app:
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as c:
            first = await c.push(make_version(), "fraud", "1.0.0")
            await c.push(make_version(seed=0.1), "fraud", "1.1.0", aliases=["canary"])
            await c.push(make_version(), "churn", "3")
        settings = app.settings
    subjects = Subjects(settings.subject_prefix)
    # A fresh NATS has no catalog: drop both buckets.
    conn = await nats.connect(settings.nats_url)
    try:
        js = conn.jetstream()
        await js.delete_key_value(subjects.models_bucket)
        await js.delete_key_value(subjects.routes_bucket)

        async with start_registry() as app:
            async with Catalog(js, subjects) as catalog:
                await catalog.wait_loaded()
                assert await catalog.wait_for(
                    lambda: len(catalog.versions) == 3 and len(catalog.routes) == 2, timeout=5
                )
                stable = catalog.resolve("fraud")
                assert stable is not None and stable.digest == first.digest
                canary = catalog.resolve("fraud", "canary")
                assert canary is not None and canary.version == "1.1.0"
                assert catalog.routes["churn"].stable == "3"
            async with httpx.AsyncClient() as http:
                resp = await http.get(f"http://127.0.0.1:{app.metrics_port}/readyz")
                assert resp.status_code == 200 and resp.json()["ready"] is True
    finally:
        await conn.close()


async def test_ops_endpoints_and_ports_file(
    start_registry: Callable[..., RegistryApp], make_version: Callable[..., Path], tmp_path: Path
) -> None:
    ports_file = tmp_path / "ports.json"
    async with start_registry(ports_file=ports_file) as app:
        ports = json.loads(ports_file.read_text())
        assert ports["grpc"] == app.grpc_port and ports["metrics"] == app.metrics_port
        async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as c:
            await c.push(make_version(), "fraud", "1")
            with pytest.raises(InvalidArgument):
                await c.push(make_version(), "fraud", "x")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.metrics_port}") as http:
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).json() == {"ready": True, "reason": "ok"}
            text = (await http.get("/metrics")).text
            assert 'inferbus_registry_pushes_total{result="created"}' in text
            assert 'inferbus_registry_pushes_total{result="invalid"}' in text
            assert "inferbus_registry_bytes_stored_total" in text


async def test_concurrent_identical_pushes_store_one_version(
    client: RegistryClient, make_version: Callable[..., Path]
) -> None:
    src = make_version()
    results = await asyncio.gather(*(client.push(src, "fraud", "1") for _ in range(4)))
    assert len({r.digest for r in results}) == 1


async def test_republishes_after_nats_loses_its_state(
    start_registry: Callable[..., RegistryApp], make_version: Callable[..., Path]
) -> None:
    # A NATS server of its own: this test wipes its JetStream state.
    with NatsServer() as server:
        async with start_registry(nats_url=server.url, store_probe_interval_s=0.05) as app:
            async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as c:
                info = await c.push(make_version(), "fraud", "1.0.0")
            await asyncio.to_thread(server.stop)
            shutil.rmtree(server.store_dir)
            await server.astart()
            subjects = app.subjects
            conn = await nats.connect(server.url)
            try:
                async with Catalog(conn.jetstream(), subjects) as catalog:
                    await catalog.wait_loaded()
                    assert await catalog.wait_for(
                        lambda: catalog.resolve("fraud") is not None, timeout=10
                    )
                    dv = catalog.resolve("fraud")
                    assert dv is not None and dv.digest == info.digest
            finally:
                await conn.close()


async def test_push_recreates_buckets_a_fresh_nats_lacks(
    start_registry: Callable[..., RegistryApp], make_version: Callable[..., Path]
) -> None:
    with NatsServer() as server:
        # No periodic republish during the test: the push itself must cope.
        async with start_registry(nats_url=server.url, store_probe_interval_s=3600) as app:
            await asyncio.to_thread(server.stop)
            shutil.rmtree(server.store_dir)
            await server.astart()
            async with RegistryClient(f"127.0.0.1:{app.grpc_port}") as c:
                # The registry's client reconnects on its own; until then the
                # push answers UNAVAILABLE (safe to retry), so retry it like a
                # client would.
                deadline = asyncio.get_running_loop().time() + 10
                while True:
                    try:
                        info = await c.push(make_version(), "fraud", "1.0.0")
                        break
                    except Unavailable:
                        if asyncio.get_running_loop().time() > deadline:
                            raise
                        await asyncio.sleep(0.05)
            conn = await nats.connect(server.url)
            try:
                kv = await conn.jetstream().key_value(app.subjects.models_bucket)
                entry = await kv.get(app.subjects.model_key("fraud", "1.0.0"))
                assert DeployedVersion.model_validate_json(entry.value or b"").digest == info.digest
            finally:
                await conn.close()


async def test_push_the_example_fraud_model(client: RegistryClient, tmp_path: Path) -> None:
    script = _FRAUD_EXAMPLE
    if not script.exists():
        pytest.skip(f"{script} is not in this checkout")
    out = tmp_path / "fraud"
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), "--out", str(out))
    assert await proc.wait() == 0
    info = await client.push(out, "fraud", "1.0.0", aliases=["stable"])
    onnx_file = json.loads((out / "config.json").read_text()).get("file", "model.onnx")
    digest = hashlib.sha256((out / onnx_file).read_bytes()).hexdigest()
    assert {f.path: f.sha256 for f in info.files}[onnx_file] == digest
