"""The PyTorch environment for `inferbus up`: its tensor workers' interpreter.

When ``.venvs/torch`` exists (``scripts/bootstrap-torch.sh``: torch plus the
worker's locked dependencies), `inferbus up` runs its tensor workers with that
environment's interpreter, so the local stack serves PyTorch versions
(``model.pt``/``model.pt2``) as well as everything else; without it the
workers run with the CLI's own interpreter and refuse PyTorch versions,
naming the script.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The repository checkout this CLI runs from (cli/src/inferbus_cli/torchenv.py → root).
REPO = Path(__file__).resolve().parents[3]
PYTHON_ENV = "INFERBUS_TORCH_PYTHON"


def find_torch_python(environ: Mapping[str, str] | None = None) -> Path | None:
    """The PyTorch environment's interpreter, or None (workers use the CLI's).

    ``$INFERBUS_TORCH_PYTHON``: a path to use, or ``off``; unset: look for
    ``.venvs/torch/bin/python`` in the current directory, then in the checkout.
    """
    env = os.environ if environ is None else environ
    if env.get(PYTHON_ENV) == "off":
        return None
    if env.get(PYTHON_ENV):
        given = Path(env[PYTHON_ENV])
        return given if given.is_file() else None
    for root in (Path.cwd(), REPO):
        candidate = root / ".venvs" / "torch" / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None
