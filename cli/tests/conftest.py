"""CLI tests: `inferbus up` starts no LLM worker unless a test asks for one.

`inferbus up` adds the LLM worker and the tiny generative model when the vLLM
environment (``.venvs/vllm``) exists; the stack tests here count processes and
models, and the LLM worker's engine would only slow them down. Tests that want
it (test_cli_up_llm.py) set ``INFERBUS_VLLM_PYTHON`` themselves.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_llm_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERBUS_VLLM_PYTHON", "off")
