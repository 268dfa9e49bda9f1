#!/usr/bin/env bash
# Install the OpenVINO execution provider's environment: a SEPARATE virtualenv
# at .venvs/openvino with onnxruntime-openvino and the tensor worker's runtime
# dependencies.
#
#   scripts/bootstrap-openvino.sh                      # onnxruntime-openvino==1.24.1
#   INFERBUS_OPENVINO_PACKAGE='onnxruntime-openvino==X' scripts/bootstrap-openvino.sh
#
# Why a separate venv: the onnxruntime-openvino wheel REPLACES the `onnxruntime`
# module (same import name, its own build with OpenVINOExecutionProvider), so it
# cannot sit beside the locked onnxruntime in the workspace's .venv. A worker
# that serves versions whose config says `engine.providers: ["openvino"]` runs
# as `.venvs/openvino/bin/python -m inferbus_worker` (in its own pool, e.g.
# `openvino`); a worker of the ordinary .venv refuses such versions with
# FAILED_PRECONDITION.
#
# The worker's and the CLI's dependencies are pinned to uv.lock's versions (`uv
# export`) except onnxruntime, which onnxruntime-openvino replaces; the inferbus
# packages are installed editable without dependencies.
# Idempotent: seconds when the venv is already there and the locked set did not change.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.local/bin:$PATH"
export UV_PYTHON_DOWNLOADS="${UV_PYTHON_DOWNLOADS:-never}"

VENV="${INFERBUS_OPENVINO_VENV:-.venvs/openvino}"
PKG="${INFERBUS_OPENVINO_PACKAGE:-onnxruntime-openvino==1.24.1}"
log() { printf '[bootstrap-openvino] %s\n' "$*" >&2; }
# shellcheck source=scripts/lib/venv.sh
source scripts/lib/venv.sh

venv_create "$VENV"
PY="$VENV/bin/python"

has_ep() {
    "$PY" -c 'import onnxruntime as o, sys; sys.exit("OpenVINOExecutionProvider" not in o.get_available_providers())' \
        >/dev/null 2>&1
}

# The locked runtime set without onnxruntime (onnxruntime-openvino provides the module).
reqs="$VENV/inferbus-requirements.txt"
venv_locked_requirements | grep -v '^onnxruntime==' > "$reqs.new"
echo "$PKG" >> "$reqs.new"
if ! cmp -s "$reqs.new" "$reqs" || ! has_ep || ! "$PY" -c 'import inferbus_cli, inferbus_worker' 2>/dev/null; then
    log "pip install the locked worker dependencies and $PKG"
    "$PY" -m pip install --quiet -r "$reqs.new"
    # A dependency that pulled in plain onnxruntime would shadow the OpenVINO build.
    if "$PY" -m pip show onnxruntime >/dev/null 2>&1; then
        "$PY" -m pip uninstall --quiet -y onnxruntime
        "$PY" -m pip install --quiet --force-reinstall --no-deps "$PKG"
    fi
    venv_install_inferbus "$PY" libs/common libs/proto libs/client services/worker-gpu cli
    mv "$reqs.new" "$reqs"
else
    rm -f "$reqs.new"
fi

"$PY" -c 'import onnxruntime as o, inferbus_worker.worker
ps = o.get_available_providers()
print("onnxruntime", o.__version__, ps)
assert "OpenVINOExecutionProvider" in ps, "no OpenVINOExecutionProvider in this onnxruntime"' >&2
log "done: run a worker that serves openvino versions with $PY -m inferbus_worker"
