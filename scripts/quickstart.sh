#!/usr/bin/env bash
# inferbus quick start for a fresh Debian/Ubuntu machine.
#
#   scripts/quickstart.sh [inferbus up options, e.g. --free-ports]
#
# Installs what is missing (scripts/bootstrap.sh), starts a local stack in the
# background, builds the example `fraud` model, pushes it as version 1
# (alias `stable`), waits until the gateway reports it ready, sends a few
# predictions and prints where to call it. Stop everything with
# `uv run inferbus down`.
#
# Environment:
#   INFERBUS_HOME              state directory (default: ./.inferbus in the repo)
#   QUICKSTART_SKIP_BOOTSTRAP  set to 1 to skip scripts/bootstrap.sh
#   QUICKSTART_READY_TIMEOUT   seconds to wait for the model (default 120)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$(pwd)"
export INFERBUS_HOME="${INFERBUS_HOME:-$repo/.inferbus}"
ready_timeout="${QUICKSTART_READY_TIMEOUT:-120}"
model_dir="$INFERBUS_HOME/example/fraud"

step() { printf '\n==> %s\n' "$*"; }

if [[ "${QUICKSTART_SKIP_BOOTSTRAP:-0}" == "1" ]]; then
    step "skipping scripts/bootstrap.sh (QUICKSTART_SKIP_BOOTSTRAP=1)"
elif [[ -f scripts/bootstrap.sh ]]; then
    step "installing prerequisites (scripts/bootstrap.sh)"
    bash scripts/bootstrap.sh
else
    step "scripts/bootstrap.sh not found; assuming uv, redis-server and the venv are ready"
fi
# bootstrap may have installed uv into ~/.local/bin.
export PATH="$HOME/.local/bin:$PATH"
if ! command -v uv >/dev/null 2>&1; then
    echo "error: uv is not installed (run scripts/bootstrap.sh or: python3 -m pip install uv)" >&2
    exit 1
fi

step "starting the stack in $INFERBUS_HOME"
if [[ -f "$INFERBUS_HOME/state.json" ]] && uv run inferbus status >/dev/null 2>&1; then
    echo "a healthy stack is already running from $INFERBUS_HOME; using it"
else
    # The gRPC edge (services/edge) when scripts/bootstrap.sh built it.
    edge=()
    if [[ -x .venv/bin/inferbus-edge ]]; then
        edge=(--edge)
    fi
    uv run inferbus up -d "${edge[@]}" "$@"
fi

step "building the example model (examples/fraud/make_model.py)"
uv run python examples/fraud/make_model.py --out "$model_dir"

step "pushing fraud version 1 as stable"
uv run inferbus models push "$model_dir" --name fraud --version 1 --alias stable

step "waiting for the model to be ready (up to ${ready_timeout}s)"
if ! uv run inferbus models wait fraud --timeout "$ready_timeout"; then
    echo "error: the fraud model did not become ready; see the logs in $INFERBUS_HOME/logs" >&2
    echo "       (worker-1.log loads the model, registry.log stores it), and" >&2
    echo "       run 'uv run inferbus status'. Stop with 'uv run inferbus down'." >&2
    exit 1
fi

step "a few predictions: inferbus infer fraud --random 3"
for _ in 1 2 3; do
    uv run inferbus infer fraud --random 3 --compact
done

# Where to call: read back from state.json (ports may differ from the defaults).
read -r grpc http metrics edge_grpc < <(uv run python - "$INFERBUS_HOME/state.json" <<'PY'
import json, sys
ep = json.load(open(sys.argv[1]))["endpoints"]
print(ep["gateway_grpc"], ep["gateway_http"], ep["gateway_metrics"], ep.get("edge_grpc", "-"))
PY
)
zeros="$(printf '0.1,%.0s' $(seq 63))0.1"

cat <<MSG

inferbus is running, with the model 'fraud' (version 1, alias stable).

  KServe V2 gRPC : $grpc   (e.g. uv run inferbus infer fraud --random 3)
  gRPC edge      : $edge_grpc   (the same gRPC API, calls spread over every gateway; '-': not built)
  KServe V2 HTTP : $http/v2/models/fraud/infer
  metrics        : $metrics   (status: uv run inferbus status)
  logs           : $INFERBUS_HOME/logs

  curl -s $http/v2/models/fraud/infer \\
       -H 'content-type: application/json' \\
       -d '{"inputs":[{"name":"input","datatype":"FP32","shape":[1,64],"data":[$zeros]}]}'

Stop everything with: uv run inferbus down
MSG
