#!/usr/bin/env bash
# Install Triton's perf_analyzer (the real binary) into its own throwaway venv.
#
#   scripts/install-perf-analyzer.sh            # into .venvs/perf_analyzer
#   INFERBUS_PERF_ANALYZER_DIR=/tmp/pa scripts/install-perf-analyzer.sh
#
# The PyPI `perf-analyzer` package is an empty placeholder; the binary ships
# in the `tritonclient` 2.41 manylinux wheel (bin/perf_analyzer), built against
# Debian's libb64 (`libb64-0d`) and CUDA's runtime (`libcudart.so.12`, from
# PyPI's `nvidia-cuda-runtime-cu12`; perf_analyzer needs no GPU to run).
# tritonclient 2.41 goes into a venv of its own, never into the uv workspace,
# where tritonclient 2.73 is the dev dependency.
#
# Leaves `$DIR/perf_analyzer`, a wrapper that sets LD_LIBRARY_PATH and runs the
# binary unmodified. Idempotent: a working install is left as it is. Downloads
# only from PyPI and the Debian archive (needs root or sudo only when libb64 is
# missing). A few seconds and ~40 MB.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.local/bin:$PATH"
export DEBIAN_FRONTEND=noninteractive
export UV_PYTHON_DOWNLOADS="${UV_PYTHON_DOWNLOADS:-never}"

DIR="${INFERBUS_PERF_ANALYZER_DIR:-.venvs/perf_analyzer}"
TRITONCLIENT="tritonclient==2.41.0"
CUDART="nvidia-cuda-runtime-cu12==12.9.79"
log() { printf '[perf-analyzer] %s\n' "$*" >&2; }
version() { "$DIR/perf_analyzer" --version 2>&1 | head -1; }

as_root() {
    if [[ "$(id -u)" == "0" ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@" || sudo "$@"
    else
        log "need root (or sudo) to run: $*"
        exit 1
    fi
}

if [[ -x "$DIR/perf_analyzer" ]] && "$DIR/perf_analyzer" --version >/dev/null 2>&1; then
    log "already installed: $(version)"
    exit 0
fi

if [[ "$(uname -m)" != "x86_64" ]]; then
    log "perf_analyzer ships for x86_64 only (this is $(uname -m))"
    exit 1
fi

if [[ "$(/sbin/ldconfig -p)" != *libb64.so.0d* ]]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        log "libb64.so.0d is missing and this is not Debian/Ubuntu: install libb64 yourself"
        exit 1
    fi
    log "apt-get install libb64-0d"
    as_root apt-get install -y -q --no-install-recommends libb64-0d ||
        { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends libb64-0d; }
fi

log "creating $DIR with $TRITONCLIENT and $CUDART"
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
uv venv -q --python python3 "$DIR"
uv pip install -q --python "$DIR/bin/python" --no-deps "$TRITONCLIENT" "$CUDART"

lib="$(cd "$DIR" && pwd)/$(cd "$DIR" && find lib -path '*nvidia/cuda_runtime/lib' -type d | head -1)"
bin="$(cd "$DIR" && pwd)/bin/perf_analyzer"
if [[ ! -x "$bin" || ! -e "$lib/libcudart.so.12" ]]; then
    log "the wheels did not bring bin/perf_analyzer and libcudart.so.12"
    exit 1
fi
cat >"$DIR/perf_analyzer" <<EOF
#!/usr/bin/env bash
# Triton's perf_analyzer from $TRITONCLIENT, unmodified (scripts/install-perf-analyzer.sh).
export LD_LIBRARY_PATH="$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$bin" "\$@"
EOF
chmod +x "$DIR/perf_analyzer"
log "installed: $(version) -> $DIR/perf_analyzer"
