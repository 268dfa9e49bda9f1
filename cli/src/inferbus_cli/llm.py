"""The generative part of `inferbus up`: the LLM worker and the tiny offline model.

When the vLLM environment exists (``.venvs/vllm``, made by
``scripts/bootstrap-llm.sh``), `inferbus up` also starts an LLM worker with that
environment's interpreter and, once the registry is up, pushes the tiny Llama
built by ``examples/tiny-llm/build.py`` as ``tiny-llm`` version 1 (alias
``stable``), so ``GET /v1/models`` lists it and ``/v1/chat/completions`` serves
it. Without the environment nothing changes (``--no-llm`` skips it too).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

from inferbus_cli.rpc import registry_channel, registry_stub
from inferbus_cli.venvs import REPO, find_venv_python
from inferbus_client.artifacts import collect_files, push_messages

TINY_MODEL = "tiny-llm"
TINY_VERSION = "1"
PYTHON_ENV = "INFERBUS_VLLM_PYTHON"


def find_vllm_python(environ: Mapping[str, str] | None = None) -> Path | None:
    """The vLLM environment's interpreter (``.venvs/vllm``), or None (no LLM worker).

    ``$INFERBUS_VLLM_PYTHON`` overrides it: a path, or ``off``.
    """
    return find_venv_python("vllm", PYTHON_ENV, environ)


def build_tiny_model(python: Path, out: Path) -> Path:
    """Build the tiny Llama version directory under `out` (once; reused after).

    Raises:
        RuntimeError: the build script is missing or failed (its stderr included).
    """
    if (out / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file():
        return out
    script = REPO / "examples" / "tiny-llm" / "build.py"
    if not script.is_file():
        raise RuntimeError(f"{script} not found: run `inferbus up` from the inferbus checkout")
    done = subprocess.run(
        [str(python), str(script), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{done.stderr[-2000:]}")
    return out


def push_tiny_model(registry: str, model_dir: Path, say: Callable[[str], None]) -> None:
    """Push the tiny model as ``tiny-llm`` 1 (alias ``stable``); an identical re-push is a no-op.

    Raises:
        RuntimeError: the registry refused it.
    """
    config_bytes, files = collect_files(model_dir, None)
    with registry_channel(registry) as channel:
        try:
            info = registry_stub(channel).PushVersion(
                push_messages(TINY_MODEL, TINY_VERSION, config_bytes, ["stable"], files),
                timeout=120,
            )
        except grpc.RpcError as exc:
            raise RuntimeError(f"pushing {TINY_MODEL}: {exc.code().name} {exc.details()}") from None
    say(f"  pushed {TINY_MODEL} {info.version} (generative, vLLM) digest {info.digest[:12]}")
