"""Fixtures of the worker's tests: the example fraud model and a real nats-server."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from inferbus_common.catalog import DeployedVersion
from inferbus_common.modelconfig import ModelConfig
from inferbus_testing.servers import NatsServer

REPO = Path(__file__).resolve().parents[3]


def _load_make_model() -> ModuleType:
    path = REPO / "examples" / "fraud" / "make_model.py"
    spec = importlib.util.spec_from_file_location("inferbus_example_make_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def make_model() -> ModuleType:
    """The example model generator (``examples/fraud/make_model.py``) as a module."""
    return _load_make_model()


@pytest.fixture(scope="session")
def fraud_dir(tmp_path_factory: pytest.TempPathFactory, make_model: ModuleType) -> Path:
    """A directory with the fraud model's ``model.onnx`` and ``config.json``."""
    out = tmp_path_factory.mktemp("fraud")
    make_model.main(["--out", str(out)])
    return out


@pytest.fixture(scope="session")
def fraud_config(fraud_dir: Path) -> ModelConfig:
    """The fraud model's config."""
    return ModelConfig.model_validate_json((fraud_dir / "config.json").read_text())


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def fraud_deployed(fraud_dir: Path, fraud_config: ModelConfig) -> DeployedVersion:
    """The fraud model as the registry would publish it (version ``1``)."""
    files = {name: sha256_of(fraud_dir / name) for name in ("model.onnx", "config.json")}
    return DeployedVersion(
        model="fraud",
        version="1",
        config=fraud_config,
        digest="sha256:" + hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest(),
        files=files,
    )


@pytest.fixture(scope="module")
def module_nats_server() -> Iterator[NatsServer]:
    """A real nats-server with JetStream, one per test module."""
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def nats_url(module_nats_server: NatsServer) -> str:
    """URL of `module_nats_server`."""
    return module_nats_server.url
