#!/usr/bin/env bash
# Regenerate the Python code for every .proto under protos/ into src/.
# The output is committed; nobody edits it by hand and ruff skips it.
# Run from anywhere:  bash libs/proto/generate.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
python=${PYTHON:-python}
mapfile -t protos < <(cd protos && find . -name '*.proto' | sed 's|^\./||' | sort)
# Typed stubs of the gRPC service classes (`_pb2_grpc.pyi`, for mypy) come from
# mypy-protobuf's plugin, installed beside the interpreter (the dev group).
plugin="$(dirname "$("$python" -c 'import sys; print(sys.executable)')")/protoc-gen-mypy_grpc"
"$python" -m grpc_tools.protoc -I protos \
  --python_out=src --grpc_python_out=src --pyi_out=src \
  --plugin=protoc-gen-mypy_grpc="$plugin" --mypy_grpc_out=src "${protos[@]}"
"$python" isolate_pool.py src
for d in $(cd protos && find . -mindepth 1 -type d | sed 's|^\./||'); do
  touch "src/$d/__init__.py"
done
