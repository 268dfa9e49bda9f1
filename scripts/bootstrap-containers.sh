#!/usr/bin/env bash
# Install what the container tests (tests/containers) and scripts/images.sh --local
# need, on a fresh Debian/Ubuntu machine:
#
#   scripts/bootstrap-containers.sh
#
#   podman, runc     the engine and the OCI runtime it is configured with
#   netavark,        container networks whose DNS lets compose services find
#   aardvark-dns     each other by name
#   debootstrap      builds the local Debian base image (scripts/base-image.sh)
#   iptables         netavark sets up every network (and published ports)
#                    with it: without it `compose up` fails with "netavark: No
#                    such file or directory"; --no-install-recommends leaves it out
#
# Idempotent: does nothing when everything is there. Needs root (or sudo). The
# engine's configuration is not touched: the tests write their own (see
# libs/testing/src/inferbus_testing/containers.py and docs/operations.md,
# "Compose with Podman"). Called by scripts/test.sh; when it fails the container
# tests skip with the reason, the rest of the suite runs.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

log() { printf '[bootstrap-containers] %s\n' "$*" >&2; }

have() {
    command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]] ||
        [[ -x "/usr/lib/podman/$1" ]] || [[ -x "/usr/libexec/podman/$1" ]]
}

missing=()
for pair in podman:podman runc:runc netavark:netavark aardvark-dns:aardvark-dns \
    debootstrap:debootstrap iptables:iptables; do
    tool="${pair%%:*}"
    package="${pair##*:}"
    have "$tool" || missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    log "podman $(podman --version | awk '{print $3}'), runc, netavark, aardvark-dns, debootstrap, iptables: present"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    log "missing ${missing[*]}, and this is not a Debian/Ubuntu machine; install them yourself"
    exit 1
fi
as_root=()
if [[ "$(id -u)" != "0" ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
        log "missing ${missing[*]}; need root (or sudo) to install them"
        exit 1
    fi
    as_root=(sudo -n)
fi
log "apt-get install ${missing[*]}"
"${as_root[@]}" apt-get update -q >/dev/null
"${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
log "podman $(podman --version | awk '{print $3}') installed"
