"""Fixtures of the registry tests: a real nats-server and tiny ONNX models.

One nats-server is shared by the registry tests of a session; every test gets
its own subject prefix, so buckets and subjects never collide between tests.
The S3 server is the shared ``s3_server`` fixture of `inferbus_testing`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from inferbus_client.registry import RegistryClient
from inferbus_registry.app import RegistryApp
from inferbus_registry.settings import RegistrySettings
from inferbus_registry.store import Store
from inferbus_testing.servers import NatsServer


@pytest.fixture(scope="session")
def registry_nats() -> Iterator[NatsServer]:
    """A real nats-server with JetStream for the whole session."""
    with NatsServer() as server:
        yield server


def write_onnx(
    path: Path,
    *,
    in_name: str = "x",
    out_name: str = "y",
    features: int = 64,
    classes: int = 2,
    elem_type: int = TensorProto.FLOAT,
    batch: str | int = "N",
    seed: float = 0.5,
) -> Path:
    """A tiny ONNX model: ``y = x @ W`` with `x` [batch, features] → `y` [batch, classes]."""
    import numpy as np

    weights = np.full((features, classes), seed, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", [in_name, "W"], [out_name])],
        "tiny",
        [helper.make_tensor_value_info(in_name, elem_type, [batch, features])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [batch, classes])],
        initializer=[numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def tiny_config(**overrides: object) -> dict[str, object]:
    """config.json of the tiny model (FP32 [-1,64] → FP32 [-1,2])."""
    config: dict[str, object] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        "max_batch_size": 32,
    }
    config.update(overrides)
    return config


@pytest.fixture
def make_version(tmp_path: Path) -> Callable[..., Path]:
    """Build a version directory (model.onnx + config.json); returns the directory."""
    counter = iter(range(1_000_000))

    def make(config: dict[str, object] | None = None, **onnx_args: object) -> Path:
        d = tmp_path / f"version-{next(counter)}"
        d.mkdir()
        write_onnx(d / "model.onnx", **onnx_args)  # type: ignore[arg-type]
        (d / "config.json").write_text(json.dumps(config if config is not None else tiny_config()))
        return d

    return make


@pytest.fixture
def registry_settings(tmp_path: Path, registry_nats: NatsServer) -> RegistrySettings:
    """Settings of an in-process registry on a local store, free ports, own prefix."""
    return RegistrySettings(
        nats_url=registry_nats.url,
        subject_prefix="t" + secrets.token_hex(4),
        grpc_port=0,
        metrics_port=0,
        store="local",
        store_dir=tmp_path / "store",
        spool_dir=tmp_path,
        use_uvloop=False,
        drain_timeout_s=1.0,
        log_format="text",
    )


@pytest.fixture
def start_registry(
    registry_settings: RegistrySettings,
) -> Callable[..., RegistryApp]:
    """Factory of (not yet started) registries sharing the test's settings."""

    def make(store_override: Store | None = None, **changes: object) -> RegistryApp:
        # Validate the changed settings like the process would.
        settings = RegistrySettings.model_validate({**registry_settings.model_dump(), **changes})
        return RegistryApp(settings, store=store_override)

    return make


@pytest.fixture
async def registry(start_registry: Callable[..., RegistryApp]) -> AsyncIterator[RegistryApp]:
    """A running in-process registry with a local store."""
    async with start_registry() as app:
        yield app


@pytest.fixture
async def client(registry: RegistryApp) -> AsyncIterator[RegistryClient]:
    """A client of the `registry` fixture."""
    async with RegistryClient(f"127.0.0.1:{registry.grpc_port}", timeout_s=10) as c:
        yield c


@pytest.fixture
def onnx_writer() -> Callable[..., Path]:
    """`write_onnx`, for tests that build their own ONNX files."""
    return write_onnx


@pytest.fixture
def config_for() -> Callable[..., dict[str, object]]:
    """`tiny_config`, for tests that build their own config.json."""
    return tiny_config
