#!/usr/bin/env bash
# Push the example `fraud` model into the compose stack once it is up, wait until
# the gateway reports it ready and send one prediction.
#
#   compose/push-example.sh            # place it on the GPU pool (worker-gpu)
#   POOL=cpu compose/push-example.sh   # the CPU pool (`--profile cpu` worker-cpu)
#   SECURE=1 compose/push-example.sh   # the secured stack (make up SECURE=1)
#
# Environment:
#   POOL             worker pool the version is placed on: gpu (default) or cpu
#   VERSION          version to push (default 1); it gets the alias `stable`
#   ENV_FILE         the stack's env file (default compose/.env): the default
#                    addresses below come from its INFERBUS_BIND and
#                    INFERBUS_HOST_PORT_REGISTRY / _GRPC / _HTTP, so a stack on
#                    moved ports gets the push, not whatever holds the defaults
#   INFERBUS_STACK_ID  the stack the push must reach (default: the env file's
#                    INFERBUS_STACK_ID, else its COMPOSE_PROJECT_NAME, else inferbus)
#   REGISTRY         registry gRPC HOST:PORT (default 127.0.0.1:8070)
#   GATEWAY_GRPC     gateway gRPC HOST:PORT (default 127.0.0.1:8001)
#   READY_TIMEOUT    seconds to wait until a worker serves it (default 180)
#   SECURE           1: push with the registry admin token and check readiness over
#                    TLS with the secrets of compose/secure-init.sh
#   GATEWAY_HTTPS    gateway HTTPS base URL when SECURE=1 (default https://127.0.0.1:8000)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
pool="${POOL:-gpu}"
version="${VERSION:-1}"
env_file="${ENV_FILE:-compose/.env}"
# One value of the env file (the last assignment wins, as in compose), or $2.
env_value() {
    local found=""
    if [[ -f "$env_file" ]]; then
        found="$(sed -n "s/^$1=//p" "$env_file" | tail -n 1)"
    fi
    printf '%s' "${found:-$2}"
}
bind="$(env_value INFERBUS_BIND 127.0.0.1)"
if [[ "$bind" == "0.0.0.0" ]]; then
    bind=127.0.0.1
fi
registry="${REGISTRY:-$bind:$(env_value INFERBUS_HOST_PORT_REGISTRY 8070)}"
# The stack the push is meant for: the registry and gateway of any other refuse
# the CLI's calls (FAILED_PRECONDITION), so nothing lands in the wrong stack.
export INFERBUS_STACK_ID="${INFERBUS_STACK_ID:-$(env_value INFERBUS_STACK_ID "$(env_value COMPOSE_PROJECT_NAME inferbus)")}"
gateway="${GATEWAY_GRPC:-$bind:$(env_value INFERBUS_HOST_PORT_GRPC 8001)}"
ready_timeout="${READY_TIMEOUT:-180}"
secure="${SECURE:-0}"
secrets="${INFERBUS_SECRETS_DIR:-compose/secrets}"
if [[ "$secure" == 1 ]]; then
    # The registry requires a token; the CLI reads it from this file.
    export INFERBUS_REGISTRY_TOKEN_FILE="${INFERBUS_REGISTRY_TOKEN_FILE:-$secrets/registry-admin.token}"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "==> building the example model (examples/fraud/make_model.py)"
uv run python examples/fraud/make_model.py --out "$work/fraud" >/dev/null

# The example config places the model on the `default` pool; the compose
# workers serve the `gpu` and `cpu` pools, so place it on the one asked for.
uv run python - "$work/fraud/config.json" "$pool" <<'PY'
import json, sys
path, pool = sys.argv[1], sys.argv[2]
config = json.load(open(path))
config["pool"] = pool
open(path, "w").write(json.dumps(config, indent=2) + "\n")
PY

echo "==> pushing fraud version $version (pool $pool, alias stable) to $registry (stack $INFERBUS_STACK_ID)"
uv run inferbus models push "$work/fraud" --name fraud --version "$version" \
    --alias stable --registry "$registry"

if [[ "$secure" == 1 ]]; then
    # The gateway serves TLS only; the CLI's gateway calls are plaintext, so ask
    # the REST API with curl and the stack's certificate instead.
    https="${GATEWAY_HTTPS:-https://$bind:$(env_value INFERBUS_HOST_PORT_HTTP 8000)}"
    echo "==> waiting up to ${ready_timeout}s for $https to report it ready (TLS)"
    deadline=$((SECONDS + ready_timeout))
    until curl -fsS --cacert "$secrets/gateway-tls.crt" "$https/v2/models/fraud/ready" >/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "fraud is not ready after ${ready_timeout}s" >&2
            exit 1
        fi
        sleep 2
    done
    echo "==> ready; predict with a TLS client (docs/security.md, \"Clients\")"
    exit 0
fi

echo "==> waiting up to ${ready_timeout}s for the gateway to report it ready"
uv run inferbus models wait fraud --url "$gateway" --timeout "$ready_timeout"

echo "==> one prediction"
uv run inferbus infer fraud --random 2 --url "$gateway" --compact
