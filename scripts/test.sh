#!/usr/bin/env bash
# Install what is missing (scripts/bootstrap.sh, scripts/bootstrap-llm.sh,
# scripts/bootstrap-torch.sh, scripts/bootstrap-openvino.sh,
# scripts/install-perf-analyzer.sh,
# scripts/bootstrap-containers.sh), check the
# code (ruff check, ruff format --check, mypy on the production code), then run
# the whole test suite.
#
#   scripts/test.sh [pytest arguments...]      e.g. scripts/test.sh -x -k catalog
#
# Works without a TTY (CI=true). A failed check stops before pytest (exit 1);
# otherwise exits with pytest's exit code. Set INFERBUS_SKIP_BOOTSTRAP=1 to skip
# the install step, INFERBUS_SKIP_CHECKS=1 to skip the checks (a quick local run).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Same PATH and uv settings as bootstrap.sh, which runs in its own process.
export PATH="$HOME/.local/bin:$PATH"
export UV_PYTHON_DOWNLOADS="${UV_PYTHON_DOWNLOADS:-never}"
# Tests fork service processes while gRPC threads run; gRPC's fork handlers can
# crash such a child before exec (see conftest.py, which sets this too).
export GRPC_ENABLE_FORK_SUPPORT="${GRPC_ENABLE_FORK_SUPPORT:-false}"

if [[ "${INFERBUS_SKIP_BOOTSTRAP:-0}" != "1" ]]; then
    bash scripts/bootstrap.sh
    # The vLLM worker's separate environment (.venvs/vllm; 1-3 min the first
    # time). Without it the generative tests skip, so a failed install is loud,
    # not fatal.
    if ! bash scripts/bootstrap-llm.sh; then
        echo "[test] WARNING: scripts/bootstrap-llm.sh failed; the vLLM tests will be SKIPPED" >&2
    fi
    # torch for the PyTorch engine in .venvs/torch (a minute the first time). Without
    # it the PyTorch tests skip, so a failed install is loud, not fatal.
    if ! bash scripts/bootstrap-torch.sh; then
        echo "[test] WARNING: scripts/bootstrap-torch.sh failed; the PyTorch engine tests" \
            "will be SKIPPED" >&2
    fi
    # onnxruntime-openvino (ONNX Runtime's OpenVINO EP) in .venvs/openvino (~35 s the
    # first time). Without it the OpenVINO tests skip, so a failed install is loud, not fatal.
    if ! bash scripts/bootstrap-openvino.sh; then
        echo "[test] WARNING: scripts/bootstrap-openvino.sh failed; the OpenVINO EP tests" \
            "will be SKIPPED" >&2
    fi
    # Triton's perf_analyzer in .venvs/perf_analyzer (a few seconds, ~40 MB).
    if ! bash scripts/install-perf-analyzer.sh; then
        echo "[test] WARNING: scripts/install-perf-analyzer.sh failed; the perf_analyzer" \
            "test will be SKIPPED" >&2
    fi
    # Podman, runc, netavark and debootstrap for tests/containers (seconds when
    # present). Without them those tests skip, so a failed install is loud, not fatal.
    if ! bash scripts/bootstrap-containers.sh; then
        echo "[test] WARNING: scripts/bootstrap-containers.sh failed; the container tests will be SKIPPED" >&2
    fi
fi

# Static checks, each on the whole tree (config in pyproject.toml). All three run
# so that one report shows every failure; any failure stops before pytest.
if [[ "${INFERBUS_SKIP_CHECKS:-0}" != "1" ]]; then
    failed=()
    echo "[test] ruff check" >&2
    uv run --frozen ruff check . || failed+=("ruff check (fix: uv run ruff check --fix .)")
    echo "[test] ruff format --check" >&2
    uv run --frozen ruff format --check . || failed+=("ruff format (fix: uv run ruff format .)")
    echo "[test] mypy (production code; strict on libs/common, libs/client, libs/testing)" >&2
    start=$SECONDS
    uv run --frozen mypy || failed+=("mypy (run: uv run mypy)")
    echo "[test] gofmt and go vet (services/edge)" >&2
    unformatted="$(gofmt -l services/edge 2>&1)" || unformatted="gofmt failed: $unformatted"
    [[ -z "$unformatted" ]] || failed+=("gofmt (run: gofmt -w services/edge): $unformatted")
    GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS= go vet ./services/edge/ ||
        failed+=("go vet ./services/edge/")
    echo "[test] mypy took $((SECONDS - start)) s" >&2
    if ((${#failed[@]})); then
        printf '[test] FAILED: %s\n' "${failed[@]}" >&2
        echo "[test] static checks failed; pytest not run" >&2
        exit 1
    fi
fi

# Colour only for people; CI logs stay plain.
color=no
if [[ -t 1 ]]; then
    color=yes
fi

exec uv run --frozen pytest --color="$color" "$@"
