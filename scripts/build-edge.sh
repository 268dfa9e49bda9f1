#!/usr/bin/env bash
# Build inferbus-edge (services/edge, Go) into .venv/bin, next to the other
# inferbus commands, from Debian's Go toolchain and Go packages (no module proxy):
#
#   scripts/build-edge.sh [--install-deps] [OUT]
#   scripts/build-edge.sh --test [go test arguments...]   (its unit tests instead)
#
# --install-deps: apt-get install golang-go golang-google-grpc-dev
# golang-github-nats-io-go-nats-dev first (root; Debian 12 ships Go 1.19,
# grpc-go 1.33 and nats.go 1.22, which this code is written for).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
testing=0
if [[ "${1:-}" == --test ]]; then
    shift
    testing=1
fi
if [[ "${1:-}" == --install-deps ]]; then
    shift
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends \
        golang-go golang-google-grpc-dev golang-github-nats-io-go-nats-dev >/dev/null
fi
out="$repo/.venv/bin/inferbus-edge"
((testing)) || out="${1:-$out}"
if ! command -v go >/dev/null 2>&1; then
    echo "build-edge: no Go toolchain: run scripts/build-edge.sh --install-deps (Debian's golang-go)" >&2
    exit 1
fi
gocode=/usr/share/gocode
for pkg in google.golang.org/grpc github.com/nats-io/nats.go; do
    if [[ ! -d "$gocode/src/$pkg" ]]; then
        echo "build-edge: $pkg is not in $gocode: run scripts/build-edge.sh --install-deps" >&2
        exit 1
    fi
done
# GOPATH mode: the edge's package under a throwaway GOPATH, Debian's packages after it.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/inferbus"
ln -s "$repo/services/edge" "$work/src/inferbus/edge"
export GO111MODULE=off GOPATH="$work:$gocode" GOCACHE="${GOCACHE:-$HOME/.cache/inferbus-go-build}" \
    GOFLAGS= CGO_ENABLED=0
if ((testing)); then
    cd "$work/src/inferbus/edge"
    go test -count=1 "$@" .
    exit
fi
mkdir -p "$(dirname "$out")"
(
    cd "$work/src/inferbus/edge"
    go build -trimpath -o "$out" .
)
echo "build-edge: built $out" >&2
