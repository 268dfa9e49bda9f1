"""The PyTorch environment for `inferbus up`: its tensor workers' interpreter.

When ``.venvs/torch`` exists (``scripts/bootstrap-torch.sh``: torch plus the
worker's locked dependencies), `inferbus up` runs its tensor workers with that
environment's interpreter, so the local stack serves PyTorch versions
(``model.pt``/``model.pt2``) as well as everything else; without it the
workers run with the CLI's own interpreter and refuse PyTorch versions,
naming the script.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from inferbus_cli.venvs import find_venv_python

PYTHON_ENV = "INFERBUS_TORCH_PYTHON"


def find_torch_python(environ: Mapping[str, str] | None = None) -> Path | None:
    """The PyTorch environment's interpreter (``.venvs/torch``), or None (workers use the CLI's).

    ``$INFERBUS_TORCH_PYTHON`` overrides it: a path, or ``off``.
    """
    return find_venv_python("torch", PYTHON_ENV, environ)
