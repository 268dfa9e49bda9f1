#!/usr/bin/env bash
# Install the PyTorch engine's environment: a SEPARATE virtualenv at .venvs/torch
# with torch (CPU wheel) and the tensor worker's runtime dependencies.
#
#   scripts/bootstrap-torch.sh                                       # torch==2.13.0 (CPU here)
#   INFERBUS_TORCH_PACKAGE='torch==2.13.0' PIP_INDEX_URL=... scripts/bootstrap-torch.sh   # a CUDA build
#
# Why a separate venv: torch is a multi-GB wheel (a CUDA build when resolved
# from PyPI by uv) that the other services never import; it never enters
# uv.lock. A worker that serves TorchScript (`model.pt`) or torch.export
# (`model.pt2`) versions runs as `.venvs/torch/bin/python -m inferbus_worker`;
# a worker of the ordinary .venv starts and serves everything else, and refuses
# such versions with FAILED_PRECONDITION naming this script.
#
# The worker's and the CLI's dependencies are pinned to uv.lock's versions (`uv
# export`), so the torch worker runs the same onnxruntime, grpcio, nats-py... as
# the others; the inferbus packages are installed editable without dependencies.
# The CLI is there for `.venvs/torch/bin/inferbus models profile` of a PyTorch
# version (torch's profiler runs where the CLI runs).
#
# Needs pip to find torch 2.13.0 (CPU: pip's find-links or PyTorch's CPU index,
# e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu on a stock machine).
# Idempotent: a venv that already imports torch is only refreshed. Takes about a
# minute and ~1 GB the first time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.local/bin:$PATH"
export UV_PYTHON_DOWNLOADS="${UV_PYTHON_DOWNLOADS:-never}"

VENV="${INFERBUS_TORCH_VENV:-.venvs/torch}"
PKG="${INFERBUS_TORCH_PACKAGE:-torch==2.13.0}"
log() { printf '[bootstrap-torch] %s\n' "$*" >&2; }
# shellcheck source=scripts/lib/venv.sh
source scripts/lib/venv.sh

venv_create "$VENV"
PY="$VENV/bin/python"

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    log "pip install $PKG (about a minute; ~1 GB)"
    "$PY" -m pip install --quiet "$PKG"
fi

# The worker's and the CLI's runtime dependencies at uv.lock's versions (torch's
# own requirements are loose enough to take the locked ones).
reqs="$VENV/inferbus-requirements.txt"
venv_locked_requirements > "$reqs.new"
# Seconds when nothing changed: pip runs only when the locked set did.
if ! cmp -s "$reqs.new" "$reqs" || ! "$PY" -c 'import inferbus_cli, inferbus_worker' 2>/dev/null; then
    "$PY" -m pip install --quiet -r "$reqs.new"
    venv_install_inferbus "$PY" libs/common libs/proto libs/client services/worker-gpu cli
    mv "$reqs.new" "$reqs"
else
    rm -f "$reqs.new"
fi

"$PY" -c 'import torch, onnxruntime, inferbus_worker.worker; print("torch", torch.__version__)' >&2
log "done: run a worker that serves .pt/.pt2 versions with $PY -m inferbus_worker"
