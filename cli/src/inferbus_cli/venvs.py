"""The extra Python environments `inferbus up` runs some of its workers with.

Heavy engines stay out of the services' lock: each lives in a virtual
environment of its own under ``.venvs/`` (``scripts/bootstrap-llm.sh`` makes
``.venvs/vllm``, ``scripts/bootstrap-torch.sh`` makes ``.venvs/torch``). One
rule finds any of them, with one environment variable per environment to point
elsewhere or to turn it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The repository checkout this CLI runs from (cli/src/inferbus_cli/venvs.py → root).
REPO = Path(__file__).resolve().parents[3]


def find_venv_python(
    name: str, variable: str, environ: Mapping[str, str] | None = None
) -> Path | None:
    """The interpreter of environment ``.venvs/<name>``, or None when there is none.

    ``$<variable>``: a path to use, or ``off``; unset: look for
    ``.venvs/<name>/bin/python`` in the current directory, then in the checkout.
    A given path that is not a file counts as none.
    """
    env = os.environ if environ is None else environ
    given = env.get(variable)
    if given == "off":
        return None
    if given:
        path = Path(given)
        return path if path.is_file() else None
    for root in (Path.cwd(), REPO):
        candidate = root / ".venvs" / name / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None
