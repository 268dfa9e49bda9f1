"""CLI tests: no LLM worker unless a test asks for one; an in-process registry.

`inferbus up` adds the LLM worker and the tiny generative model when the vLLM
environment (``.venvs/vllm``) exists; the stack tests here count processes and
models, and the LLM worker's engine would only slow them down. Tests that want
it (test_cli_up_llm.py) set ``INFERBUS_VLLM_PYTHON`` themselves.

`registry` is the real registry in this process (real nats-server, local
store) for the tests that drive the CLI's blocking gRPC code against it.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from inferbus_registry.app import RegistryApp
from inferbus_registry.settings import RegistrySettings
from inferbus_testing.examples import make_fraud_model
from inferbus_testing.servers import NatsServer


@pytest.fixture(autouse=True)
def _no_llm_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERBUS_VLLM_PYTHON", "off")


@pytest.fixture(scope="module")
def registry_nats() -> Iterator[NatsServer]:
    """A real nats-server with JetStream, shared by the registries of one test module."""
    with NatsServer() as server:
        yield server


@pytest.fixture
async def registry(tmp_path: Path, registry_nats: NatsServer) -> AsyncIterator[RegistryApp]:
    """A started registry on a local store, free ports and its own subject prefix.

    Rollouts are judged every 50 ms so that rollout steps pass quickly.
    """
    settings = RegistrySettings(
        nats_url=registry_nats.url,
        subject_prefix="c" + secrets.token_hex(4),
        grpc_port=0,
        metrics_port=0,
        store="local",
        store_dir=tmp_path / "store",
        spool_dir=tmp_path,
        use_uvloop=False,
        drain_timeout_s=1.0,
        log_format="text",
        rollout_tick_s=0.05,
    )
    async with RegistryApp(settings) as app:
        yield app


@pytest.fixture
def fraud_model(tmp_path: Path) -> Path:
    """The example fraud model (examples/fraud/make_model.py), built in ``tmp_path/fraud``."""
    out = tmp_path / "fraud"
    make_fraud_model(out)
    return out
