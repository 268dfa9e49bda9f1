"""The generative part of `inferbus up`: the LLM worker and the tiny offline model.

When the vLLM environment exists (``.venvs/vllm``, made by
``scripts/bootstrap-llm.sh``), `inferbus up` also starts an LLM worker with that
environment's interpreter and, once the registry is up, pushes the tiny Llama
built by ``examples/tiny-llm/build.py`` as ``tiny-llm`` version 1 (alias
``stable``), so ``GET /v1/models`` lists it and ``/v1/chat/completions`` serves
it. Without the environment nothing changes (``--no-llm`` skips it too).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

from inferbus_cli.rpc import registry_channel, registry_stub
from inferbus_client.artifacts import collect_files, push_messages

#: The repository checkout this CLI runs from (cli/src/inferbus_cli/llm.py → root).
REPO = Path(__file__).resolve().parents[3]
TINY_MODEL = "tiny-llm"
TINY_VERSION = "1"
PYTHON_ENV = "INFERBUS_VLLM_PYTHON"


def find_vllm_python(environ: Mapping[str, str] | None = None) -> Path | None:
    """The vLLM environment's interpreter, or None (no LLM worker).

    ``$INFERBUS_VLLM_PYTHON``: a path to use, or ``off``; unset: look for
    ``.venvs/vllm/bin/python`` in the current directory, then in the checkout.
    """
    env = os.environ if environ is None else environ
    if env.get(PYTHON_ENV) == "off":
        return None
    if env.get(PYTHON_ENV):
        given = Path(env[PYTHON_ENV])
        return given if given.is_file() else None
    for root in (Path.cwd(), REPO):
        candidate = root / ".venvs" / "vllm" / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None


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
