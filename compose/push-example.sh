#!/usr/bin/env bash
# Push the example `fraud` model into the compose stack once it is up, wait until
# the gateway reports it ready and send one prediction.
#
#   compose/push-example.sh            # place it on the GPU pool (worker-gpu)
#   POOL=cpu compose/push-example.sh   # the CPU pool (`--profile cpu` worker-cpu)
#
# Environment:
#   POOL             worker pool the version is placed on: gpu (default) or cpu
#   VERSION          version to push (default 1); it gets the alias `stable`
#   REGISTRY         registry gRPC HOST:PORT (default 127.0.0.1:8070)
#   GATEWAY_GRPC     gateway gRPC HOST:PORT (default 127.0.0.1:8001)
#   READY_TIMEOUT    seconds to wait until a worker serves it (default 180)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
pool="${POOL:-gpu}"
version="${VERSION:-1}"
registry="${REGISTRY:-127.0.0.1:8070}"
gateway="${GATEWAY_GRPC:-127.0.0.1:8001}"
ready_timeout="${READY_TIMEOUT:-180}"

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

echo "==> pushing fraud version $version (pool $pool, alias stable) to $registry"
uv run inferbus models push "$work/fraud" --name fraud --version "$version" \
    --alias stable --registry "$registry"

echo "==> waiting up to ${ready_timeout}s for the gateway to report it ready"
uv run inferbus models wait fraud --url "$gateway" --timeout "$ready_timeout"

echo "==> one prediction"
uv run inferbus infer fraud --random 2 --url "$gateway" --compact
